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
    assert state.awaiting_resume and state.resume_due and state.retained_is_newest
    with pytest.raises(InternalError, match="CONTINUING -> FRESH"):
        state.bound(continuing=False)
    with pytest.raises(InternalError, match="loaded over retained memory"):
        state.loaded()  # an attached process loads nothing before its first step
    state.resumed()
    assert state.start is StartMode.RESUMED and state.retained_is_newest and not state.resume_due
    state.stepped()
    assert state.start is StartMode.TRAINING and not state.retained_is_newest and not state.before_first_step
    state.recorded()
    state.unbound()
    state.unbound()  # once freed, freeing again changes nothing
    state.bound(continuing=False)
    assert state.start is StartMode.FRESH and not state.awaiting_resume and not state.attached
    with pytest.raises(InternalError, match="FRESH -> RESUMED"):
        state.resumed()
    state.loaded()
    state.loaded()  # a second checkpoint before the first step
    assert state.resume_due and not state.awaiting_resume and state.before_first_step
    state.resumed()
    state.loaded()  # not attached: a checkpoint after leto_resume() and before a step
    assert not state.boundary_due()
    with pytest.raises(InternalError, match="BOUNDARY -> BOUNDARY"):
        state.recorded()
    state.stepped()  # without leto_resume(): the loop positioned itself
    state.stepped()  # two steps before the loop's next batch
    assert state.boundary_due() and state.phase is StepPhase.STEPPED and state.start is StartMode.TRAINING
    with pytest.raises(InternalError, match="TRAINING -> LOADED"):
        state.loaded()  # after a step, load_state() reloads into the running job
    state.recorded()
    assert not state.boundary_due()
