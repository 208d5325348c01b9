"""The agent's explicit state: the phase of the job and the phase of a failure's handling.

Each is an enum with its allowed transitions written here, owned by exactly one object (the
``Agent`` owns the ``JobPhase``, ``Recovery`` the ``RecoveryPhase``) that changes it through
one ``PhaseTracker.advance``; an illegal transition is a bug (``IllegalTransition``) and is
raised, never silently taken. Every phase is also visible in the event log (docs/events.md).

``JobPhase`` (the job as a whole)::

    STARTING    -> RUNNING | STOPPED | INTERRUPTED
    RUNNING     -> RECOVERING | FINISHED | STOPPED | INTERRUPTED
    RECOVERING  -> RUNNING | STOPPED | INTERRUPTED
    FINISHED, STOPPED, INTERRUPTED: terminal

``RecoveryPhase`` (one failure, from detection until the books of its recovery are closed)::

    IDLE        -> CLASSIFYING                     a failure was detected
    CLASSIFYING -> STOPPING | RESTARTING           HOF: recover in place; else checkpoint restart
    STOPPING    -> REPAIRING | CLASSIFYING         every active trainer stopped, on every node / a node lost
    REPAIRING   -> PROMOTING | RESTARTING | CLASSIFYING  retained state repaired / unusable / a node lost
    PROMOTING   -> RESUMING | CLASSIFYING          shadows promoted or cold trainers started / a node lost
    RESUMING    -> CONFIRMING | CLASSIFYING        every rank resumed / one failed meanwhile
    CONFIRMING  -> IDLE | CLASSIFYING              every rank finished an iteration / one failed first
    RESTARTING  -> IDLE                            the trainers restart from the last checkpoint

A failure while recovering starts the next generation (``RESUMING``/``CONFIRMING`` ->
``CLASSIFYING``). ``JobStopped`` and ``JobInterrupted`` end the job from any phase.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from typing import Generic, TypeVar

from ..errors import InternalError, LetoError


class IllegalTransition(InternalError):
    """A phase change the transition table does not allow: a bug in the agent."""


class JobStopped(LetoError):
    """The job cannot go on (failure budget, no recovery path); the message says why."""


class NodeLost(LetoError):
    """The agent of another node stopped beating (``membership.Membership.lost``): its slots
    need a spare before any lockstep step can complete."""

    def __init__(self, nodes: list[int]) -> None:
        super().__init__(f"node(s) {nodes} lost: their agents stopped beating")
        self.nodes = nodes


class NodeRetired(LetoError):
    """This node left the job (a failure that is not a HOF, with a spare free): a spare takes
    its slot; its agent stops its trainers, frees its memory and exits."""


class JobInterrupted(LetoError):
    """A stop request (SIGINT/SIGTERM to the launcher) won over whatever the agent was doing."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class JobPhase(enum.Enum):
    STARTING = "starting"  # the store, the job id, the first trainers and shadows
    RUNNING = "running"  # training; the agent watches for failures
    RECOVERING = "recovering"  # a failure is handled (in place, or from the checkpoint)
    FINISHED = "finished"  # every active trainer completed training
    STOPPED = "stopped"  # the job cannot go on (JobStopped, a full run dir)
    INTERRUPTED = "interrupted"  # a stop request


class RecoveryPhase(enum.Enum):
    IDLE = "idle"
    CLASSIFYING = "classifying"
    STOPPING = "stopping"
    REPAIRING = "repairing"
    PROMOTING = "promoting"
    RESUMING = "resuming"
    CONFIRMING = "confirming"
    RESTARTING = "restarting"


_J, _R = JobPhase, RecoveryPhase
_ENDS = frozenset({_J.STOPPED, _J.INTERRUPTED})
JOB_TRANSITIONS: Mapping[JobPhase, frozenset[JobPhase]] = {
    _J.STARTING: frozenset({_J.RUNNING}) | _ENDS,
    _J.RUNNING: frozenset({_J.RECOVERING, _J.FINISHED}) | _ENDS,
    _J.RECOVERING: frozenset({_J.RUNNING}) | _ENDS,
    _J.FINISHED: frozenset(),
    _J.STOPPED: frozenset(),
    _J.INTERRUPTED: frozenset(),
}
RECOVERY_TRANSITIONS: Mapping[RecoveryPhase, frozenset[RecoveryPhase]] = {
    _R.IDLE: frozenset({_R.CLASSIFYING}),
    _R.CLASSIFYING: frozenset({_R.STOPPING, _R.RESTARTING}),
    _R.STOPPING: frozenset({_R.REPAIRING, _R.CLASSIFYING}),
    _R.REPAIRING: frozenset({_R.PROMOTING, _R.RESTARTING, _R.CLASSIFYING}),
    _R.PROMOTING: frozenset({_R.RESUMING, _R.CLASSIFYING}),
    _R.RESUMING: frozenset({_R.CONFIRMING, _R.CLASSIFYING}),
    _R.CONFIRMING: frozenset({_R.IDLE, _R.CLASSIFYING}),
    _R.RESTARTING: frozenset({_R.IDLE}),
}

P = TypeVar("P", bound=enum.Enum)


class PhaseTracker(Generic[P]):
    """The current phase of one thing and the only way to change it."""

    def __init__(self, what: str, initial: P, transitions: Mapping[P, frozenset[P]]) -> None:
        missing = [p.name for p in type(initial) if p not in transitions]
        if missing:
            raise InternalError(f"{what}: no transitions listed for {missing}")
        self._what = what
        self._current = initial
        self._transitions = transitions

    @property
    def current(self) -> P:
        return self._current

    def advance(self, new: P) -> P:
        """Move to ``new``; returns the phase left. Raises ``IllegalTransition`` if the table
        does not allow it."""
        old = self._current
        if new not in self._transitions[old]:
            allowed = ", ".join(sorted(p.name for p in self._transitions[old])) or "none: terminal"
            raise IllegalTransition(f"{self._what}: {old.name} -> {new.name} is not allowed (from {old.name}: "
                                    f"{allowed})")
        self._current = new
        return old

    def __repr__(self) -> str:
        return f"PhaseTracker({self._what}: {self._current.name})"
