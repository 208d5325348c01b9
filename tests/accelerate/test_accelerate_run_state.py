"""The run state of ``LetoAccelerator``: every transition the docstring of ``state.py`` allows
works, every other raises ``InternalError`` (a pure state object, no accelerator).
"""

from __future__ import annotations

import pytest

from leto_lightning.errors import InternalError
from leto_lightning.integrations.accelerate.state import RunState, StartMode, StepPhase


def test_accelerator_run_state() -> None:
    state = RunState()
    with pytest.raises(InternalError, match="UNBOUND -> RESUMED"):
        state.resumed()  # leto_resume() before binding is refused earlier, as a UsageError
    state.bound(continuing=True)
    assert state.awaiting_resume and state.continuing
    with pytest.raises(InternalError, match="CONTINUING -> FRESH"):
        state.bound(continuing=False)
    state.resumed()
    assert state.start is StartMode.RESUMED and state.continuing and not state.awaiting_resume
    state.unbound()
    state.unbound()  # once freed, freeing again changes nothing
    state.bound(continuing=False)
    assert state.start is StartMode.FRESH and not state.awaiting_resume
    with pytest.raises(InternalError, match="FRESH -> RESUMED"):
        state.resumed()
    assert not state.boundary_due()
    with pytest.raises(InternalError, match="BOUNDARY -> BOUNDARY"):
        state.recorded()
    state.stepped()
    state.stepped()  # two steps before the loop's next batch
    assert state.boundary_due() and state.phase is StepPhase.STEPPED
    state.recorded()
    assert not state.boundary_due()
