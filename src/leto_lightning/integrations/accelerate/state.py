"""How a ``LetoAccelerator`` run starts (``StartMode``) and where its step is (``StepPhase``).

Both are owned by one ``RunState`` per accelerator; each changes in one method that checks the
transition against its table and raises ``InternalError`` for any other. Whether the process
*attached* to a job's retained store (a shadow, ``LETO_RESUME=retained``) is fixed when it binds.

``StartMode``::

    UNBOUND --bound(continuing=False)--> FRESH       a new store; ``leto_resume()`` returns None
            --bound(continuing=True)---> CONTINUING  attached to a job's retained store: the loop
                                                     must call ``leto_resume()`` before training
    FRESH, LOADED, RESUMED --loaded--> LOADED        ``load_state()`` before this process's first
                                                     step re-initialised the store from a checkpoint:
                                                     ``leto_resume()`` says where it was (optional:
                                                     without it the loop positions itself)
                                                     (RESUMED only when not attached)
    CONTINUING, LOADED --resumed--> RESUMED          ``leto_resume()`` put everything back
    FRESH, LOADED, RESUMED --stepped--> TRAINING     this process committed a step: ``load_state()``
                                                     from here on is a reload into the running job
    TRAINING --stepped--> TRAINING
    every bound mode --unbound--> UNBOUND            ``end_training`` freed the store (no agent)

``StepPhase`` -- the resume payload of the last committed step::

    BOUNDARY  no step since the last boundary payload (or none yet): nothing due
    STEPPED   a step committed since: its ``prepare`` payload is replaced by a ``boundary`` one
              when the loop fetches its next batch (or at ``end_training`` in the exact mode)

    BOUNDARY, STEPPED --stepped-->  STEPPED
    STEPPED           --recorded--> BOUNDARY
"""

from __future__ import annotations

from enum import Enum

from ...errors import InternalError


class StartMode(Enum):
    """How this accelerator's retained state began (module doc)."""

    UNBOUND = "unbound"
    FRESH = "fresh"
    CONTINUING = "continuing"
    LOADED = "loaded"
    RESUMED = "resumed"
    TRAINING = "training"


class StepPhase(Enum):
    """Whether a committed step still waits for its boundary payload (module doc)."""

    BOUNDARY = "boundary"
    STEPPED = "stepped"


_BOUND = frozenset(StartMode) - {StartMode.UNBOUND}
_START_NEXT: dict[StartMode, frozenset[StartMode]] = {
    StartMode.UNBOUND: frozenset({StartMode.FRESH, StartMode.CONTINUING}),
    StartMode.FRESH: frozenset({StartMode.UNBOUND, StartMode.LOADED, StartMode.TRAINING}),
    StartMode.CONTINUING: frozenset({StartMode.RESUMED, StartMode.UNBOUND}),
    StartMode.LOADED: frozenset({StartMode.LOADED, StartMode.RESUMED, StartMode.TRAINING, StartMode.UNBOUND}),
    StartMode.RESUMED: frozenset({StartMode.LOADED, StartMode.TRAINING, StartMode.UNBOUND}),
    StartMode.TRAINING: frozenset({StartMode.TRAINING, StartMode.UNBOUND}),
}
_PHASE_NEXT: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.BOUNDARY: frozenset({StepPhase.STEPPED}),
    StepPhase.STEPPED: frozenset({StepPhase.STEPPED, StepPhase.BOUNDARY}),
}


class RunState:
    """The start mode and the step phase of one ``LetoAccelerator`` (module doc)."""

    def __init__(self) -> None:
        self.start = StartMode.UNBOUND
        self.phase = StepPhase.BOUNDARY
        self.attached = False  # bound to a job's existing retained store (fixed at bound())

    def __repr__(self) -> str:
        return f"RunState({self.start.name}, {self.phase.name}{', attached' if self.attached else ''})"

    def _set_start(self, start: StartMode) -> None:
        if start not in _START_NEXT[self.start]:
            raise InternalError(f"LetoAccelerator: start mode {self.start.name} -> {start.name} is not a transition")
        self.start = start

    def _set_phase(self, phase: StepPhase) -> None:
        if phase not in _PHASE_NEXT[self.phase]:
            raise InternalError(f"LetoAccelerator: step phase {self.phase.name} -> {phase.name} is not a transition")
        self.phase = phase

    @property
    def awaiting_resume(self) -> bool:
        """Attached to retained memory and not yet put back: steps and batches are refused."""
        return self.start is StartMode.CONTINUING

    @property
    def resume_due(self) -> bool:
        """``leto_resume()`` has a payload to put back (after a recovery, or a checkpoint load)."""
        return self.start in (StartMode.CONTINUING, StartMode.LOADED)

    @property
    def before_first_step(self) -> bool:
        """Bound, and no step committed by this process yet."""
        return self.start in (StartMode.FRESH, StartMode.CONTINUING, StartMode.LOADED, StartMode.RESUMED)

    @property
    def retained_is_newest(self) -> bool:
        """Attached to retained memory and no step since: newer than any checkpoint, so
        ``load_state()`` loads nothing (a script that always loads one stays correct)."""
        return self.attached and self.before_first_step

    def bound(self, continuing: bool) -> None:
        self._set_start(StartMode.CONTINUING if continuing else StartMode.FRESH)
        self.attached = continuing

    def loaded(self) -> None:
        if self.attached:
            raise InternalError("LetoAccelerator: a checkpoint was loaded over retained memory it attached to")
        self._set_start(StartMode.LOADED)

    def resumed(self) -> None:
        self._set_start(StartMode.RESUMED)

    def unbound(self) -> None:
        if self.start in _BOUND:
            self._set_start(StartMode.UNBOUND)
            self.attached = False

    def stepped(self) -> None:
        self._set_start(StartMode.TRAINING)
        self._set_phase(StepPhase.STEPPED)

    def boundary_due(self) -> bool:
        return self.phase is StepPhase.STEPPED

    def recorded(self) -> None:
        self._set_phase(StepPhase.BOUNDARY)
