"""How a ``LetoAccelerator`` run starts (``StartMode``) and where its step is (``StepPhase``).

Both are owned by one ``RunState`` per accelerator; each changes in one method that checks the
transition against its table and raises ``InternalError`` for any other.

``StartMode``::

    UNBOUND --bound(continuing=False)--> FRESH       a new store; ``leto_resume()`` returns None
            --bound(continuing=True)---> CONTINUING  attached to a job's retained store: the loop
                                                     must call ``leto_resume()`` before training
    FRESH --loaded--> CONTINUING                     ``load_state()`` re-initialised the store from a
                                                     checkpoint: ``leto_resume()`` says where it was
    CONTINUING --resumed--> RESUMED                  ``leto_resume()`` put everything back
    FRESH, CONTINUING, RESUMED --unbound--> UNBOUND  ``end_training`` freed the store (no agent)

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
    RESUMED = "resumed"


class StepPhase(Enum):
    """Whether a committed step still waits for its boundary payload (module doc)."""

    BOUNDARY = "boundary"
    STEPPED = "stepped"


_BOUND = frozenset({StartMode.FRESH, StartMode.CONTINUING, StartMode.RESUMED})
_START_NEXT: dict[StartMode, frozenset[StartMode]] = {
    StartMode.UNBOUND: frozenset({StartMode.FRESH, StartMode.CONTINUING}),
    StartMode.FRESH: frozenset({StartMode.UNBOUND, StartMode.CONTINUING}),
    StartMode.CONTINUING: frozenset({StartMode.RESUMED, StartMode.UNBOUND}),
    StartMode.RESUMED: frozenset({StartMode.UNBOUND}),
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

    def __repr__(self) -> str:
        return f"RunState({self.start.name}, {self.phase.name})"

    def _set_start(self, start: StartMode) -> None:
        if start not in _START_NEXT[self.start]:
            raise InternalError(f"LetoAccelerator: start mode {self.start.name} -> {start.name} is not a transition")
        self.start = start

    def _set_phase(self, phase: StepPhase) -> None:
        if phase not in _PHASE_NEXT[self.phase]:
            raise InternalError(f"LetoAccelerator: step phase {self.phase.name} -> {phase.name} is not a transition")
        self.phase = phase

    @property
    def continuing(self) -> bool:
        """Bound to a job's retained store (``leto_resume()`` called or not)."""
        return self.start in (StartMode.CONTINUING, StartMode.RESUMED)

    @property
    def awaiting_resume(self) -> bool:
        return self.start is StartMode.CONTINUING

    def bound(self, continuing: bool) -> None:
        self._set_start(StartMode.CONTINUING if continuing else StartMode.FRESH)

    def loaded(self) -> None:
        self._set_start(StartMode.CONTINUING)

    def resumed(self) -> None:
        self._set_start(StartMode.RESUMED)

    def unbound(self) -> None:
        if self.start in _BOUND:
            self._set_start(StartMode.UNBOUND)

    def stepped(self) -> None:
        self._set_phase(StepPhase.STEPPED)

    def boundary_due(self) -> bool:
        return self.phase is StepPhase.STEPPED

    def recorded(self) -> None:
        self._set_phase(StepPhase.BOUNDARY)
