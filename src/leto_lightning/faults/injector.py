"""Faults injected into a launched trainer from its environment (``LETO_FAULTS``).

Tests, benchmarks and the demo hand ``leto launch`` a list of faults; the launcher passes it to
every trainer, and each trainer installs a ``FaultInjector`` as the hook of the injection points
(``faults.points``). At the chosen point of the chosen iteration the trainer really dies: a
SIGKILL (or the signal or exit code the fault names), nothing cleans up. Each fault fires once
per job, across restarts and promotions: whether it fired is kept by the job (the agent's store),
not by the process that dies.

A fault is ``{"id", "rank", "point", "iteration" (omit: any), "occurrence" (default 1),
"action": "kill" (default) | "exit", "code", "signal" (what to kill with, e.g. 7 = SIGBUS),
"wait_shadows" (strike only once the shadow set is ready: the steady state of a long job; a
string: once that shadow set, e.g. "0-1", is the ready one), "generation" (omit: any)}``.

A leaf beside ``points``: what the injector needs from the trainer it strikes (where it stands,
the job's record of fired faults) comes through ``FaultTarget``, which the runtime's session
provides, so this module imports nothing from the runtime.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .points import set_hook

Fault = Mapping[str, Any]  # one entry of LETO_FAULTS (keys above)


class FaultTarget(Protocol):
    """The trainer a ``FaultInjector`` strikes, as the injector sees it."""

    @property
    def rank(self) -> int:
        """The global rank: only faults naming it are this trainer's."""
        ...

    def striking(self) -> bool:
        """True while faults may fire: an active trainer (a waiting shadow is never struck)."""
        ...

    def position(self) -> tuple[int, int]:
        """(iteration, generation) the trainer is at now."""
        ...

    def fired(self, fault_id: object) -> bool:
        """Whether the job recorded fault ``fault_id`` as fired (by any process, any generation)."""
        ...

    def mark_fired(self, fault_id: object) -> None:
        """Record, before striking, that fault ``fault_id`` fired (it never fires twice)."""
        ...

    def ready_shadow_set(self) -> str:
        """The shadow set ready to be promoted (``"<generation>-<replacement>"``), "" none yet."""
        ...


class FaultInjector:
    """The injection-point hook that fires this trainer's faults (see the module docstring)."""

    def __init__(self, faults: Sequence[Fault], target: FaultTarget) -> None:
        self.target = target
        mine = [f for f in faults if f.get("rank") == target.rank]
        self.pending = [f for f in mine if not target.fired(f["id"])]
        self.counts: dict[object, int] = {}

    def install(self) -> None:
        """Become the injection-point hook when any fault is still to fire."""
        if self.pending:
            set_hook(self)

    def __call__(self, name: str, context: dict) -> None:
        if not self.target.striking():
            return
        it, gen = self.target.position()
        for f in self.pending:
            if f["point"] == name and f.get("iteration", it) == it and f.get("generation", gen) == gen:
                n = self.counts[f["id"]] = self.counts.get(f["id"], 0) + 1
                if n == f.get("occurrence", 1) and not self.target.fired(f["id"]):
                    if f.get("wait_shadows"):
                        self._wait_for_shadows(f["wait_shadows"])
                    self.target.mark_fired(f["id"])
                    strike(f)

    def _wait_for_shadows(self, wait_shadows: object) -> None:
        """The steady state of a long job: strike once a shadow set (or the one named) is ready."""
        want = wait_shadows if isinstance(wait_shadows, str) else None
        while not (ready := self.target.ready_shadow_set()) or (want is not None and ready != want):
            time.sleep(0.05)


def strike(fault: Fault) -> None:
    """End this process as ``fault`` says: an exit code (e.g. one declared non-HOF) or a signal."""
    if fault.get("action", "kill") == "exit":
        os._exit(int(fault.get("code", 1)))
    os.kill(os.getpid(), int(fault.get("signal", signal.SIGKILL)))  # "signal": e.g. SIGBUS
    os.kill(os.getpid(), signal.SIGKILL)  # a signal the process survives
