"""Every redundant copy of the retained metadata is used and kept redundant (issue 25, items 11
and 12): the two copies of each metadata item are judged item by item (one copy of one item and
the other copy of another item lost is still a full set), and recovery verifies and rewrites
each damaged copy -- spec, completion mark, undo header, metadata mirror, progress record -- so
the next hit on its twin does not lose the store. Damage is real: bytes overwritten in the
stores' /dev/shm segments."""

from __future__ import annotations

import pytest
import torch

from leto_lightning.retained.integrity import Metadata
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences, snapshot
from leto_lightning.updater.recovery import recover_node
from tests.updater.crash_cases import _shadow_step

torch.set_num_threads(1)
STEPS = 2
REFERENCES: dict[str, list] = {}


def _reference(optimizer: str) -> list:
    if optimizer not in REFERENCES:
        REFERENCES[optimizer] = CoreScenario(optimizer=optimizer).reference(STEPS + 1)
    return REFERENCES[optimizer]


@pytest.fixture
def job(request):
    job = CoreScenario(optimizer=getattr(request, "param", "adamw")).create_job()
    job.run(STEPS)
    yield job
    job.close()


def _recover(job):
    stores = {r: RetainedStore.attach(job.job_id, r) for r in range(job.scenario.n_ranks)}
    try:
        return recover_node(stores)
    finally:
        for s in stores.values():
            s.close()


def _check_state(job, iteration: int) -> None:
    """Bind fresh skeletons (a shadow's view) and compare with the fault-free run."""
    ref = _reference(job.scenario.optimizer)
    for r in range(job.scenario.n_ranks):
        model, ro = job.attach_trainer(r)
        try:
            assert ro.iteration == iteration
            assert not differences(snapshot(model, ro.optimizer), ref[r][iteration])
        finally:
            ro.store.close()


# -- item 11: metadata copies judged item by item ----------------------------------------------
def _primary_chunk(store, c):
    store.chunk_table[c, 0] ^= 1 << 40  # the commit mark's word in the primary copy


def _mirror_chunk(store, c):
    store.mirror["versions"][c] ^= 1 << 40


def _primary_state(store):
    store.flags[7] ^= 1 << 20  # a flags word: covered by the scalar state's checksum


def _mirror_state(store):
    store.mirror["flags"][7] ^= 1 << 20


CROSSED = {  # one copy of one item, the other copy of a different item
    "primary chunk 0 + mirror of the last chunk": lambda s: (_primary_chunk(s, 0), _mirror_chunk(s, -1)),
    "mirror chunk 0 + primary of the last chunk": lambda s: (_mirror_chunk(s, 0), _primary_chunk(s, -1)),
    "primary chunk 0 + mirror state": lambda s: (_primary_chunk(s, 0), _mirror_state(s)),
    "mirror chunk 0 + primary state": lambda s: (_mirror_chunk(s, 0), _primary_state(s)),
}


@pytest.mark.parametrize("job", ["rmsprop_whole", "nadam_whole", "adamw"], indirect=True)
@pytest.mark.parametrize("damage", list(CROSSED))
def test_crossed_damage_to_both_metadata_copies_is_repaired(job, damage):
    """Whole-state optimizers (RMSprop; NAdam, whose ``mu_product`` is scalar state) repaired as
    Adam is; both copies valid again afterwards (a second recovery repairs nothing)."""
    CROSSED[damage](job.stores[0])
    reports = _recover(job)
    assert {rep.resume_iteration for rep in reports.values()} == {STEPS}
    assert len(reports[0].metadata_repaired) == 2, reports[0].metadata_repaired
    assert all(not rep.restored for rep in reports.values())  # nothing was rolled back from the undo copy
    assert all(not rep.metadata_repaired for rep in _recover(job).values())
    _check_state(job, STEPS)


def test_crossed_damage_before_the_whole_state_commit_still_restores():
    """The item-by-item rule never takes an uncommitted transaction for a committed one: killed
    after the step and its checksums but before the commit, the same crossed damage leaves the
    last chunk with no copy at the new version, so the step is undone and redone exactly."""
    job = CoreScenario(optimizer="rmsprop_whole").create_job()
    try:
        job.run(STEPS)
        assert run_in_child(lambda: _shadow_step(job, 0, STEPS), kill_at=KillPoint("whole.checksummed")).killed
        run_in_child(lambda: _shadow_step(job, 1, STEPS))
        CROSSED["primary chunk 0 + mirror of the last chunk"](job.stores[0])
        reports = _recover(job)
        assert reports[0].restored == [(-1, "whole-state")] and reports[0].pending_step
        _check_state(job, STEPS + 1)
    finally:
        job.close()


# -- item 12: every redundant copy verified and rewritten ----------------------------------------
def _spec_bytes(store) -> torch.Tensor:
    return store.segments["spec"].tensor


def test_spec_copy_1_is_verified_and_rewritten(job):
    """Copy 1 used to be read only when copy 0 failed: its damage went unnoticed until copy 0 was
    hit too, and then the store was lost."""
    spec = _spec_bytes(job.stores[0])
    half = spec.numel() // 2
    spec[half + 64 + 40] ^= 0x55
    attached = RetainedStore.attach(job.job_id, 0)
    found = attached.spec_findings
    attached.close()
    first = _recover(job)
    spec[64 + 40] ^= 0x55  # now copy 0: the rewritten copy 1 serves
    second = _recover(job)
    _check_state(job, STEPS)
    assert any("spec copy 1" in f for f in found)
    assert any("spec copy 1 (rewritten)" in f for f in first[0].metadata_repaired)
    assert any("spec copy 0 (rewritten)" in f for f in second[0].metadata_repaired)
    assert bytes(spec[64:half].numpy()) == bytes(spec[half + 64 :].numpy())


def test_a_damaged_completion_mark_is_rewritten(job):
    """A mark left damaged used to lose the store at the next hit on the other copy."""
    spec = _spec_bytes(job.stores[0])
    half = spec.numel() // 2
    spec[3] ^= 0x11  # mark 0
    first = _recover(job)
    spec[half + 3] ^= 0x11  # mark 1: mark 0, rewritten, still says "complete"
    second = _recover(job)
    _check_state(job, STEPS)
    assert any("completion mark copy 0 (rewritten)" in f for f in first[0].metadata_repaired)
    assert any("completion mark copy 1 (rewritten)" in f for f in second[0].metadata_repaired)
    assert job.stores[0].is_complete()


@pytest.mark.parametrize("job", ["adamw", "rmsprop_whole"], indirect=True)
@pytest.mark.parametrize("copy", [0, 1])
def test_a_damaged_undo_header_copy_is_reported_and_rewritten(job, copy):
    store = job.stores[0]
    store.undo_copies[copy][1] ^= 1 << 33  # the version word: the copy fails its checksum
    reports = _recover(job)
    assert f"undo header copy {copy} (rewritten)" in " ".join(reports[0].metadata_repaired)
    meta = Metadata(store)
    assert meta._head_seq(0) is not None and meta._head_seq(0) == meta._head_seq(1)
    _check_state(job, STEPS)


def test_a_damaged_progress_record_copy_is_rewritten(job):
    """Each entry is kept twice; a damaged copy of the newest entry is rewritten, so a later hit
    on its twin still finds the newest entry (committed, not the older prepared one)."""
    record = job.stores[0].record
    newest = record.read().seq
    slots = [i for i, s in enumerate(record._slots) if getattr(record._read_slot(s), "seq", None) == newest]
    assert len(slots) == 2
    record._slots[slots[0]][40] ^= 0xFF
    first = _recover(job)
    record._slots[slots[1]][40] ^= 0xFF
    second = _recover(job)
    assert second[0].status_found == "committed" and second[0].iteration_found == STEPS - 1
    assert any(f"progress-record slot {slots[0]} (rewritten" in f for f in first[0].metadata_repaired)
    assert any(f"progress-record slot {slots[1]} (rewritten" in f for f in second[0].metadata_repaired)
    _check_state(job, STEPS)


def _damage_spec_copy_1(store):
    spec = _spec_bytes(store)
    spec[spec.numel() // 2 + 64 + 40] ^= 0x55


def _damage_mark_0(store):
    _spec_bytes(store)[3] ^= 0x11


def _damage_header_copy_1(store):
    store.undo_copies[1][1] ^= 1 << 33


def _damage_newest_record_copy(store):
    record = store.record
    newest = record.read().seq
    slot = next(s for s in record._slots if getattr(record._read_slot(s), "seq", None) == newest)
    slot[40] ^= 0xFF


ONE_COPY = {"spec copy 1": _damage_spec_copy_1, "completion mark 0": _damage_mark_0,
            "undo header copy 1": _damage_header_copy_1, "progress-record slot": _damage_newest_record_copy}


@pytest.mark.parametrize("damage", list(ONE_COPY))
def test_recovery_killed_while_rewriting_a_copy_keeps_its_twin(job, damage):
    """SIGKILL in the middle of rewriting a damaged copy: the intact twin was never written, so
    the next recovery rewrites the copy and the state is exact."""
    ONE_COPY[damage](job.stores[0])
    killed = run_in_child(lambda: _recover(job), kill_at=KillPoint("recovery.copy_rewrite"))
    assert killed.killed
    reports = _recover(job)
    assert any("(rewritten" in f for f in reports[0].metadata_repaired)
    assert all(not rep.metadata_repaired for rep in _recover(job).values())
    _check_state(job, STEPS)
