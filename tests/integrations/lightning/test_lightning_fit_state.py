"""The fit mode and batch phase of ``LetoStrategy``: every transition the docstring of
``fit_state.py`` allows works, every other raises ``InternalError``.

Pure state objects (no trainer): what the fits in the other tests drive them through, checked
one transition at a time, including the ones no fit reaches.
"""

from __future__ import annotations

import pickle

import pytest

from leto_lightning.errors import InternalError
from leto_lightning.integrations.lightning.fit_state import BatchPhase, FitMode, FitState

STARTS = [FitMode.FRESH, FitMode.FROM_FILE, FitMode.FROM_RETAINED, FitMode.SHADOW]


@pytest.mark.parametrize("mode", STARTS)
def test_a_fit_begins_from_none_and_ends_back_there(mode: FitMode) -> None:
    state = FitState()
    state.end()  # teardown of validate/test: NONE stays NONE
    ckpt = "last.ckpt" if mode is FitMode.FROM_FILE else None
    state.begin(mode, ckpt)
    assert (state.mode, state.ckpt_file) == (mode, ckpt)
    assert state.mode.from_retained_memory == (mode in (FitMode.FROM_RETAINED, FitMode.SHADOW))
    assert state.mode.continues == (mode is not FitMode.FRESH)
    with pytest.raises(InternalError, match=f"{mode.name} -> FRESH"):
        state.begin(FitMode.FRESH)  # a fit cannot begin inside another
    state.end()
    assert (state.mode, state.ckpt_file) == (FitMode.NONE, None)


def test_a_fit_begins_only_as_a_real_mode_with_its_file() -> None:
    state = FitState()
    for mode, ckpt in [(FitMode.NONE, None), (FitMode.FROM_FILE, None), (FitMode.FRESH, "x.ckpt")]:
        with pytest.raises(InternalError):
            state.begin(mode, ckpt)
    assert state.mode is FitMode.NONE


def test_batch_phases_of_steps_micro_batches_and_validation() -> None:
    state = FitState()
    assert state.phase is BatchPhase.IDLE and not state.batch_open
    state.step_committed()  # outside a training batch: recorded at prepare only
    assert state.phase is BatchPhase.IDLE
    state.batch_started()
    assert state.phase is BatchPhase.COMPUTING and state.batch_open
    state.step_committed()
    state.step_committed()  # manual optimization: several steps in one batch
    assert state.phase is BatchPhase.STEPPED and state.batch_open
    state.batch_ended(recorded=True)
    assert state.phase is BatchPhase.RECORDED and not state.batch_open
    state.batch_ended(recorded=False)  # a batch end without a start (the loader yielded None)
    assert state.phase is BatchPhase.ACCUMULATING
    state.batch_started()
    state.batch_ended(recorded=False)  # an accumulation micro-batch
    assert state.phase is BatchPhase.ACCUMULATING
    with pytest.raises(InternalError, match="ACCUMULATING -> STEPPED"):
        state._set_phase(BatchPhase.STEPPED)  # a step belongs to an open batch
    with pytest.raises(InternalError, match="-> IDLE"):
        state._set_phase(BatchPhase.IDLE)


def test_the_validation_rerun_is_taken_once_and_a_copy_is_detached() -> None:
    state = FitState()
    state.begin(FitMode.FROM_RETAINED)
    state.resumed_into_validation(True)
    state.batch_started()
    copy = pickle.loads(pickle.dumps(state.detached()))
    assert (copy.mode, copy.phase) == (FitMode.NONE, BatchPhase.COMPUTING)
    assert state.take_validation_rerun() and not state.take_validation_rerun()
    assert copy.take_validation_rerun()
