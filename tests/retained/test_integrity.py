"""The integrity pieces one by one: the completion mark (a trainer dying during set-up), a damaged
parity page next to a lost data page, the false alarm of a damaged newest record slot, the spec
as checksummed JSON, and the error family of everything recovery and bind raise."""

from __future__ import annotations

import os
import random

import pytest
import torch

from leto_lightning import new_job_id
from leto_lightning.errors import IncompleteStoreError, LetoError, RetainedStateError, UnrecoverableDamageError
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.retained.spec import StoreSpec
from leto_lightning.retained.store import RetainedStore, StoreMissingError
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences, snapshot
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.retained_optimizer import RetainedOptimizer, layout_for
from tests.updater.crash_cases import _shadow_step
from tests.updater.test_corruption import _poison

torch.set_num_threads(1)
STEPS = 2


@pytest.fixture
def trained():
    sc = CoreScenario()
    ref = sc.reference(STEPS + 1)
    job = sc.create_job()
    job.run(STEPS)
    yield sc, job, ref
    job.close()


def _stores(job):
    return {r: RetainedStore.attach(job.job_id, r) for r in range(job.scenario.n_ranks)}


def _check_state(job, ref, iteration):
    for r in range(job.scenario.n_ranks):
        model, ro = job.attach_trainer(r)
        assert ro.iteration == iteration
        assert not differences(snapshot(model, ro.optimizer), ref[r][iteration])
        ro.store.close()


@pytest.mark.parametrize("point", ["create", "bind", "tier2"])
def test_a_trainer_dying_during_set_up_leaves_a_store_recovery_refuses(point):
    """Killed after the segments exist but before the mark: recognisably half-initialised."""
    sc = CoreScenario(n_ranks=1)
    job_id = new_job_id()

    def set_up():
        _model, opt = sc.build(0)
        spec = StoreSpec(job_id, 0, 0, 0, 1, layout_for(opt, sc.config), sc.config.for_device("cpu"))
        store = RetainedStore.create(spec)
        if point != "create":
            RetainedOptimizer(opt, store).bind(adopt=False)
        if point == "tier2":
            store.mark_complete()
            RetainedOptimizer(opt, store).bind(adopt=False)  # set up again: the mark is withdrawn first
        os._exit(9)  # dies here, cleaning nothing up (the segments outlive it)

    try:
        assert run_in_child(set_up).exit_code == 9
        store = RetainedStore.attach(job_id, 0)
        assert not store.is_complete()
        with pytest.raises(IncompleteStoreError, match="half-initialised"):
            recover_node({0: store})
        _model, opt = sc.build(0)
        with pytest.raises(IncompleteStoreError, match="half-initialised"):
            RetainedOptimizer(opt, store).bind(adopt=True)
        store.close()
    finally:
        unlink_segments(job_id)
    with pytest.raises(StoreMissingError) as err:  # nothing left: also a FileNotFoundError
        RetainedStore.attach(job_id, 0)
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, RetainedStateError)


def test_created_stores_are_complete(trained):
    _, job, _ = trained
    assert all(s.is_complete() for s in job.stores)


def test_a_damaged_parity_page_is_skipped_and_rewritten(trained):
    """Two parity pages per group: one bad parity page plus one lost data page is repaired with
    the other parity page, and the bad parity page is rewritten (tier 2 cannot help: the same
    page is lost on both devices)."""
    _sc, job, ref = trained
    rng = random.Random(5)
    store0 = job.stores[0]
    plan = store0.spec.tier1
    g = next(g for g, pages in enumerate(plan.groups) if store0.layout.page_kind[pages[0]] == "param")
    page = plan.groups[g][1]
    for store in job.stores:
        _poison(store, page, rng)
        store.parity1[g][0].add_(1)  # the XOR row (the one a single loss would use) is damaged
    stores = _stores(job)
    reports = recover_node(stores)
    for r in stores:
        assert reports[r].repair.tier1[r] == [page] and g in reports[r].reencoded_tier1
        stores[r].close()
    again = recover_node(_stores(job))
    assert all(rep.reencoded_tier1 == [] and rep.repair.repaired == 0 for rep in again.values())
    _check_state(job, ref, STEPS)


def test_damaged_newest_record_slot_while_the_next_iteration_runs_is_no_alarm(trained):
    """The newest slot (committed t) is lost while iteration t + 1 is in its compute phase (the
    gradients already rewritten): the older entry (prepared t, every chunk committed) is enough."""
    _sc, job, ref = trained
    assert run_in_child(lambda: _shadow_step(job, 0, STEPS), kill_at=KillPoint("compute.begin")).killed
    store = job.stores[0]
    grads = [p for p in range(store.layout.n_pages) if store.layout.page_kind[p] == "grad"]
    store.pages[grads].add_(3)  # every gradient page differs from its checksum: beyond any parity
    newest = store.record.read().seq
    for slot in store.record._slots:  # both copies of the newest entry
        if store.record._read_slot(slot) is not None and store.record._read_slot(slot).seq == newest:
            slot[40] ^= 0xFF
    reports = recover_node(_stores(job))
    assert reports[0].status_found == "prepared" and reports[0].resume_iteration == STEPS
    _check_state(job, ref, STEPS)


def test_spec_is_checksummed_json_with_two_copies(trained):
    _, job, _ = trained
    store = job.stores[0]
    raw = bytes(store.segments["spec"].tensor.numpy())
    assert b'"job_id"' in raw and b"\x80\x04" not in raw[:64]  # JSON, not a pickle
    half = len(raw) // 2
    store.segments["spec"].tensor[64 + 40] ^= 0x55  # copy 0 damaged: copy 1 serves, copy 0 is rewritten
    attached = RetainedStore.attach(job.job_id, 0)
    assert attached.spec == store.spec and attached.spec_findings
    reports = recover_node({0: attached, 1: RetainedStore.attach(job.job_id, 1)})
    assert any("spec copy 0" in f for f in reports[0].metadata_repaired)
    spec_bytes = store.segments["spec"].tensor
    assert bytes(spec_bytes[:half].numpy())[64:] == bytes(spec_bytes[half:].numpy())[64:]


def test_only_leto_errors_leave_recover_node(trained):
    _, job, _ = trained
    store = job.stores[0]
    store.chunk_table[:, 0] = 10**12  # every commit mark and ...
    store.mirror["versions"][:] = -(10**12)  # ... its mirror: the chunk table is gone
    with pytest.raises(UnrecoverableDamageError, match="chunk 0.*both copies.*checkpoint") as err:
        recover_node(_stores(job))
    assert isinstance(err.value, LetoError) and "meta" in str(err.value)
