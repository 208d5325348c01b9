"""The rollback window of manual optimization: SIGKILL anywhere between an iteration's prepare
and its seal rolls the iteration back on every rank (whole-state undo) and the job redoes it;
after the seal it is kept. Either way the result is bit-identical to plain ``torch.optim``."""

from __future__ import annotations

import os

import pytest
import torch

from leto_lightning import new_job_id
from leto_lightning.retained.store import RetainedStore, StoreSpec
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences, run_step
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.retained_optimizer import RetainedOptimizer, layout_for

from .crash_cases import MAX_T, _recover_and_continue, run_case, step_points

torch.set_num_threads(1)

CASES = int(os.environ.get("LETO_CRASH_CASES", 400 if os.environ.get("LETO_LONG") else 24))


@pytest.fixture(scope="module", params=["adamw", "sgd_nesterov"])
def prepared(request):
    sc = CoreScenario(optimizer=request.param, rollback=True)
    return sc, sc.reference(MAX_T + 2), step_points(sc)


def test_rollback_window_sigkill_points_bit_identical(prepared) -> None:
    scenario, reference, points = prepared
    names = {p.name for p in points}
    assert {"whole.undo_saved", "whole.math_done", "whole.committed", "commit.recorded", "seal.begin",
            "record.half_written"} <= names
    results = [run_case(scenario, reference, points, seed) for seed in range(CASES)]
    bad = [(seed, r) for seed, r in enumerate(results) if not r.ok]
    assert not bad, f"{len(bad)} of {CASES} cases not bit-identical or resumed wrongly; first: {bad[0]}"
    redone = [r for r in results if r.resume_iteration == r.iteration]
    assert redone and any("rolled back" in line for r in redone for line in r.reports)


@pytest.mark.parametrize("kill, resume", [("commit.recorded", 1), ("record.half_written#3", 1),
                                          ("seal.recorded", 2)])
def test_sealed_iterations_are_kept_open_ones_redone(prepared, kill, resume) -> None:
    """Rank 1 killed after its commit (open), inside its seal's record write (torn: still
    open) or after the seal: iteration 1 is redone, redone, kept."""
    scenario, reference, _ = prepared
    name, _, occurrence = kill.partition("#")
    job = scenario.create_job()
    try:
        for r in range(2):
            job.step(r, 0)
        job.step(0, 1)
        assert run_in_child(lambda: _one(job, 1, 1), kill_at=KillPoint(name, int(occurrence or 1))).killed
        got, states, reports = run_in_child(lambda: _recover_and_continue(job, 3)).value
        assert got == resume, reports
        for r in range(2):
            assert not differences(states[r], reference[r][4]), (r, reports)
    finally:
        job.close()


def test_open_peer_rolls_back_a_rank_already_in_the_next_prepare(prepared) -> None:
    """Rank 0 sealed t and prepared t + 1 (blocked at its barrier); rank 1 died between its
    commit and its seal: both roll back t, both redo it."""
    scenario, reference, _ = prepared
    job = scenario.create_job()
    try:
        for r in range(2):
            job.step(r, 0)

        def rank0_two_steps():
            model, ro = job.attach_trainer(0)
            run_step(scenario, model, ro, 0, 1)
            run_step(scenario, model, ro, 0, 2)

        assert run_in_child(rank0_two_steps, kill_at=KillPoint("prepare.barrier", 2)).killed
        assert run_in_child(lambda: _one(job, 1, 1), kill_at=KillPoint("seal.begin")).killed
        resume, states, reports = run_in_child(lambda: _recover_and_continue(job, 3)).value
        assert resume == 1, reports
        for r in range(2):
            assert not differences(states[r], reference[r][4]), (r, reports)
    finally:
        job.close()


def test_damaged_undo_copy_is_refused(prepared) -> None:
    """An open iteration whose undo copy was overwritten cannot be rolled back: recovery says so
    (the runtime then restarts from a checkpoint) instead of resuming on corrupt state."""
    scenario, _, _ = prepared
    job = scenario.create_job()
    try:
        for r in range(2):
            job.step(r, 0)
        assert run_in_child(lambda: _one(job, 1, 1), kill_at=KillPoint("seal.begin")).killed
        job.stores[1].undo[:64].fill_(0xA5)  # a page of the undo copy overwritten
        stores = {r: RetainedStore.attach(job.job_id, r) for r in range(2)}
        try:
            with pytest.raises(Exception, match="undo copy of open iteration 1 is damaged"):
                recover_node(stores)
        finally:
            for s in stores.values():
                s.close()
    finally:
        job.close()


def test_two_steps_without_a_seal_are_refused() -> None:
    sc = CoreScenario(rollback=True, n_ranks=1)
    job = sc.create_job()
    try:
        model, ro = job.trainers[0]
        ro.zero_grad()
        sc.compute(model, 0, 0)
        ro.step()
        with pytest.raises(RuntimeError, match="at most once per training_step"):
            ro.step()
    finally:
        job.close()


def test_rollback_window_needs_a_whole_state_layout() -> None:
    sc = CoreScenario(n_ranks=1)
    _, opt = sc.build(0)
    config = sc.config.for_device("cpu")
    store = RetainedStore.create(StoreSpec(new_job_id(), 0, 0, 0, 1, layout_for(opt, config), config))
    try:
        with pytest.raises(ValueError, match="whole_state=True"):
            RetainedOptimizer(opt, store, rollback_window=True)  # a chunked layout
    finally:
        store.unlink()
        store.close()
    ro = RetainedOptimizer.create(sc.build(0)[1], sc.config, rollback_window=True)  # picks the whole-state layout
    try:
        assert ro.layout.family == "generic" == layout_for(opt, sc.config, whole_state=True).family
    finally:
        ro.store.unlink()
        ro.store.close()


def _one(job, rank: int, t: int) -> None:
    model, ro = job.attach_trainer(rank)
    run_step(job.scenario, model, ro, rank, t)
