"""Retained memory: shared-memory segments, layout, progress record, configuration errors."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from leto_lightning import new_job_id
from leto_lightning.faults.points import point
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.layout import build_layout
from leto_lightning.retained.record import ProgressEntry, ProgressRecord, RecordStatus
from leto_lightning.retained.shm import SHM_DIR, SharedSegment, list_segments, segment_name, unlink_segments
from leto_lightning.testing.crash import KillPoint, run_in_child


def test_segments_are_private_and_survive_their_creator():
    job = new_job_id()
    name = segment_name(job, "x")

    def make():
        seg = SharedSegment.create(name, 4096)
        seg.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        return stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode)

    try:
        mode = run_in_child(make).value  # the creating process exits ...
        assert mode == 0o600
        seg = SharedSegment.attach(name)  # ... and the memory is still there
        assert seg.tensor[:4].tolist() == [1, 2, 3, 4]
        seg.close()
    finally:
        assert unlink_segments(job) == [name]
    assert name not in list_segments()


def test_close_leaves_memory_a_tensor_still_views_mapped():
    """``close`` drops this process's mapping only once no tensor views it: a model whose
    parameters are views of a freed store stays usable (it crashed with SIGSEGV when ``close``
    unmapped under the views). Run in a child: a crash must fail the test, not end the session."""
    job = new_job_id()

    def use_after_close() -> list[int]:
        seg = SharedSegment.create(segment_name(job, "x"), 4096)
        view = seg.tensor[8:12]
        view.copy_(torch.tensor([5, 6, 7, 8], dtype=torch.uint8))
        seg.unlink()
        seg.close()
        view.add_(1)  # the memory is still mapped: written and read back
        return view.tolist()

    result = run_in_child(use_after_close)
    assert result.signal is None and result.value == [6, 7, 8, 9]
    assert not list_segments("leto-" + job)


def test_record_survives_a_torn_write():
    buf = torch.zeros(2 * 4096, dtype=torch.uint8)
    rec = ProgressRecord(buf, on_half_written=lambda: point("record.half_written"))
    rec.write(ProgressEntry(RecordStatus.COMMITTED, 1))
    rec.write(ProgressEntry(RecordStatus.COMMITTED, 2))
    shared = torch.zeros(2 * 4096, dtype=torch.uint8).share_memory_()
    shared.copy_(buf)

    def torn_write():
        ProgressRecord(shared, on_half_written=lambda: point("record.half_written")).write(
            ProgressEntry(RecordStatus.COMMITTED, 3, {"x": "y" * 1000}))

    assert run_in_child(torn_write, kill_at=KillPoint("record.half_written")).killed
    entry = ProgressRecord(shared).read()
    assert entry.progress == ProgressEntry(RecordStatus.COMMITTED, 2)  # the newest intact entry, never the torn one
    ProgressRecord(shared).write(ProgressEntry(RecordStatus.PREPARED, 3, hparams=({"lr": 0.1},), skip_params=(1,)))
    assert ProgressRecord(shared).read().progress == ProgressEntry(RecordStatus.PREPARED, 3, hparams=({"lr": 0.1},),
                                                                   skip_params=(1,))


def test_record_holds_progress_entries_only():
    import pickle

    from leto_lightning.errors import RecoveryError
    from leto_lightning.retained import record as record_module

    rec = ProgressRecord(torch.zeros(2 * 1024, dtype=torch.uint8))
    with pytest.raises(ValueError, match="ProgressEntry"):
        rec.write({"status": "committed", "iteration": 1, "payload": None})  # the on-disk form is record.py's own
    rec.write(ProgressEntry(RecordStatus.COMMITTED, 1, {"rng": 7}, has_before=True, before=None))
    assert rec.read().progress == ProgressEntry(RecordStatus.COMMITTED, 1, {"rng": 7}, has_before=True)
    # A foreign writer's checksummed slot that is no progress entry: reported, never taken for one.
    body = pickle.dumps({"status": "done", "iteration": 2})
    head = record_module._HEADER.pack(record_module._MAGIC, 5, len(body), record_module._crc(5, len(body), body))
    rec._slots[0][: len(head) + len(body)] = torch.frombuffer(bytearray(head + body), dtype=torch.uint8)
    with pytest.raises(RecoveryError, match="entry 5 is not a progress entry .status 'done'"):
        rec.read()


def test_record_rejects_oversized_payload():
    rec = ProgressRecord(torch.zeros(256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="record_bytes"):
        rec.write(ProgressEntry(RecordStatus.COMMITTED, 0, "x" * 1000))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tier1_parity=9, data_pages=8), "tier1_parity=9 exceeds data_pages=8"),
    (dict(data_pages=250, tier1_parity=6), "> 255"),
    (dict(page_bytes=1000), "page_bytes=1000"),
    (dict(page_bytes=0), "page_bytes=0"),
    (dict(tier2_parity=-1), "tier2_parity=-1"),
    (dict(engine="gpu"), "engine='gpu'"),
])
def test_invalid_settings_are_rejected_by_name(kwargs, needle):
    with pytest.raises(ValueError) as err:
        RetainedConfig(**kwargs)
    assert needle in str(err.value)


def test_tier2_parity_checked_against_devices():
    with pytest.raises(ValueError, match="tier2_parity=3 exceeds the 2 devices"):
        RetainedConfig(tier2_parity=3).check_devices(2)


def test_page_size_must_hold_whole_elements():
    with pytest.raises(ValueError, match="not a multiple of the float64 element size"):
        build_layout([[("w", (4,), torch.float64)]], family="adam", page_bytes=4)


def test_layout_chunks_cover_every_element_once():
    groups = [[("a", (5, 7), torch.float32), ("b", (3,), torch.bfloat16), ("c", (100,), torch.float32)],
              [("d", (1,), torch.float32)]]
    lay = build_layout(groups, family="adam", group_options=[{}, {}], page_bytes=64, chunk_pages=2)
    covered = {}
    for _c, pieces in enumerate(lay.chunk_pieces):
        for param, start, stop in pieces:
            covered[param] = covered.get(param, 0) + (stop - start)
    assert covered == {p.index: p.numel for p in lay.params}
    assert [p.name for p in lay.params] == ["a", "b", "c", "d"]


def test_generic_optimizer_state_is_in_the_layout_not_in_the_param_groups():
    from leto_lightning.retained.layout import GenericState
    from leto_lightning.retained.spec import StoreSpec
    from leto_lightning.updater.retained_optimizer import layout_for

    params = torch.nn.Linear(3, 2).parameters()
    cfg = RetainedConfig()
    lay = layout_for(torch.optim.RMSprop(params, lr=0.1, momentum=0.5, centered=True), cfg)
    assert lay.generic == GenericState(("grad_avg", "momentum_buffer", "square_avg"), (), has_step=True)
    assert not any(k.startswith("_leto") for hp in lay.group_hparams for k in hp)
    sgd = layout_for(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), cfg, whole_state=True)
    assert sgd.generic == GenericState((), (), has_step=False)
    spec = StoreSpec(new_job_id(), 0, 0, 0, 1, lay, cfg.for_device("cpu"))
    assert StoreSpec.from_json(spec.to_json()).layout.generic == lay.generic  # kept by the checksummed spec
    with pytest.raises(ValueError, match="GenericState is for family 'generic'"):
        build_layout([[("w", (4,), torch.float32)]], family="adam", page_bytes=64, generic=lay.generic)


def test_agreement_from_every_ranks_progress():
    from leto_lightning.updater.recovery import Agreement, RankProgress, local_agreement

    prepared, committed = RecordStatus.PREPARED, RecordStatus.COMMITTED
    both = {0: RankProgress(prepared, 5), 1: RankProgress(prepared, 5)}
    assert local_agreement(both) == Agreement(5, True, None)
    # one rank never prepared 5: not everyone reached it; as it arrives from another node (a JSON list)
    assert local_agreement({0: RankProgress(prepared, 5), 1: ["committed", 4, False]}) == Agreement(5, False, None)
    assert local_agreement({0: RankProgress(committed, 7, open=True), 1: None}) == Agreement(7, False, 7)
    assert local_agreement({}) == Agreement(None, True, None)


@pytest.mark.parametrize("chunk_pages,data_pages", [(1, 8), (2, 3), (1, 1)])
def test_tier1_groups_follow_the_chunks(chunk_pages, data_pages):
    """Group order is the fused Adam update's walk: a chunk's pages are consecutive in it, page
    ``j`` of every kind together (the kernel folds a block's three deltas into one parity
    block); gradients are grouped apart; every page is in exactly one group, at the column
    ``column`` says."""
    from leto_lightning.retained.groups import Tier1Plan
    from leto_lightning.retained.layout import GRAD

    groups = [[("a", (1000,), torch.float32), ("b", (77,), torch.float32)], [("c", (300,), torch.float64)]]
    lay = build_layout(groups, family="adam", group_options=[{}, {}], page_bytes=256, chunk_pages=chunk_pages)
    plan = Tier1Plan(lay, data_pages, 1, include_grads=True)
    order = [p for g in plan.groups for p in g]
    assert sorted(order) == list(range(lay.n_pages))
    assert all(len(g) <= data_pages for g in plan.groups)
    for chunk in range(lay.n_chunks):
        kinds = lay.update_kinds(int(lay.chunk_segment[chunk]))
        walk = [lay.chunk_page_range(chunk, k)[j] for j in range(chunk_pages) for k in kinds]
        at = order.index(walk[0])
        assert order[at : at + len(walk)] == walk
    segment_of = {p: r.segment for r in lay.regions for p in range(r.first_page, r.first_page + r.n_pages)}
    for g, pages in enumerate(plan.groups):
        assert len({lay.page_kind[p] == GRAD for p in pages}) == 1  # never gradients and state in one group
        assert len({segment_of[p] for p in pages}) == 1
        assert [plan.column(p) for p in pages] == list(range(len(pages)))
        assert all(plan.page_group[p] == g for p in pages)


def test_attach_waits_for_the_creator_to_size_the_segment(monkeypatch):
    """``create`` is ``shm_open`` then ``ftruncate``: a peer attaching in between (the node's ranks
    racing for the tier-2 segment) must wait for the size, not fail on an empty file; an empty
    segment whose creator died is refused with a clear error instead of mmap's ValueError."""
    import signal
    import time

    from leto_lightning.errors import IncompleteStoreError
    from leto_lightning.retained import shm

    job = new_job_id()
    name = segment_name(job, "tier2")
    fd = shm._shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # created, not yet sized
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the creator, late with its ftruncate
        time.sleep(0.3)
        os.ftruncate(fd, 8192)
        os._exit(0)
    try:
        seg = SharedSegment.attach(name)
        assert seg.nbytes == 8192
        seg.close()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        pid = 0
        empty = segment_name(job, "empty")
        os.close(shm._shm_open(empty, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # its creator "died" here
        monkeypatch.setattr(shm, "SIZING_WAIT_S", 0.2)
        with pytest.raises(IncompleteStoreError, match="still empty after 0.2 s"):
            SharedSegment.attach(empty)
    finally:
        os.close(fd)
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        unlink_segments(job)
    assert not [s for s in list_segments() if job in s]
