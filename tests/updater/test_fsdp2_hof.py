"""A HOF under FSDP2: one rank's trainer SIGKILLed in the middle of its chunk transactions (the
other rank is then SIGKILLed wherever it is, as its peer is gone), the node's retained shards
rolled forward by ``updater.recovery.recover_node`` in a separate process, and new trainers that
re-bind to the same stores continue: bit-identical to the fault-free run.
"""

from __future__ import annotations

import signal

import pytest
import torch

from leto_lightning import new_job_id
from leto_lightning.retained.layout import GRAD
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import run_in_child
from leto_lightning.updater.recovery import recover_node

from .conftest import run_job
from .fsdp2_job import ACCUMULATE, STEPS, WORLD, Job, run_ranks
from .test_fsdp2_identity import assert_same_state

CHUNKS = 3  # per rank and iteration (the layout of the job's shards)


def _recover(job_id: str, wipe_rank: int = -1) -> list[tuple[int, str, int, list[int]]]:
    """``recover_node`` over the node's stores (after overwriting all of ``wipe_rank``'s data
    pages: its shard's params, grads and optimizer state)."""
    stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
    try:
        if wipe_rank >= 0:
            stores[wipe_rank].pages.fill_(0x5A)
        reports = recover_node(stores)
        if wipe_rank >= 0:  # which tier rebuilt which page
            return [(r.rank, str(r.status_found), r.committed_iteration,
                     [sorted(getattr(r.repair, tier, {}).get(r.rank, [])) for tier in ("tier1", "tier2")])
                    for r in reports.values()]
        return [(r.rank, str(r.status_found), r.committed_iteration, r.rolled_forward) for r in reports.values()]
    finally:
        for store in stores.values():
            store.close()


@pytest.mark.parametrize(("iteration", "kills"), [
    (0, ((1, "chunk.undo_copied", 1),)),
    (2, ((1, "chunk.tier2_done", 2 * CHUNKS + 2),)),
    (1, ((0, "chunk.math_done", CHUNKS + 2), (1, "chunk.tier1_done", CHUNKS + 3))),  # both ranks at once
], ids=["rank1-undo-copied", "rank1-tier2-done", "both-ranks"])
def test_rank_killed_mid_update_rolls_forward_bit_identical(tmp_path, plain_fsdp2, iteration, kills):
    job_id = new_job_id()
    try:
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        codes = run_ranks(Job(rendezvous=str(tmp_path / "crashed.rdzv"), out_dir=str(crashed), steps=STEPS,
                              retained=True, job_id=job_id, kills=kills))
        # a rank reaching its point kills itself; the harness then kills the other wherever it is
        assert codes == dict.fromkeys(range(WORLD), -signal.SIGKILL) or (
            len(kills) == 1 and codes[1] == -signal.SIGKILL and codes[0] != 0), f"exit codes {codes} for {kills}"

        recovery = run_in_child(lambda: _recover(job_id), timeout=60)
        assert recovery.exit_code == 0, recovery
        reports = {rank: (status, committed, rolled) for rank, status, committed, rolled in recovery.value}
        assert all(committed == iteration for _, committed, _ in reports.values()), reports
        if len(kills) == 1:  # the killed rank was mid-update: prepared, rolled forward
            assert reports[1][0] == "prepared" and reports[1][2], f"rank 1: {reports[1]}"
        else:
            assert any(rolled for _, _, rolled in reports.values()), reports

        continued = run_job(tmp_path, "continued", retained=True, job_id=job_id, attach=True)
    finally:
        unlink_segments(job_id)
    assert_same_state(plain_fsdp2, continued, f"killed at {kills} (iteration {iteration})")
    for rank in range(WORLD):
        tail = plain_fsdp2[rank]["losses"][(iteration + 1) * ACCUMULATE:]
        assert len(continued[rank]["losses"]) == len(tail) > 0
        assert all(torch.equal(x, y) for x, y in zip(tail, continued[rank]["losses"])), f"rank {rank}: losses"
        assert continued[rank]["in_store"] and continued[rank]["padding_zero"]
        assert set(continued[rank]["versions"]) == {STEPS}


def test_rank_shard_data_overwritten_rebuilt_from_tier2_bit_identical(tmp_path, plain_fsdp2):
    """Rank 1 killed as iteration 2's update begins, then every data page of its store (its
    whole shard: params, grads, AdamW state) overwritten: beyond tier 1 (each tier-1 group loses
    all its pages), so tier 2 rebuilds the shard from rank 0's pages and the node's parity;
    nothing is replicated under FSDP2, so no other copy exists."""
    job_id = new_job_id()
    iteration = 2
    try:
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        codes = run_ranks(Job(rendezvous=str(tmp_path / "crashed.rdzv"), out_dir=str(crashed), steps=STEPS,
                              retained=True, job_id=job_id, kills=((1, "prepare.begin", iteration + 1),)))
        assert codes[1] == -signal.SIGKILL, f"rank 1 was not killed: exit codes {codes}"

        recovery = run_in_child(lambda: _recover(job_id, wipe_rank=1), timeout=60)
        assert recovery.exit_code == 0, recovery
        reports = {rank: (committed, tiers) for rank, _, committed, tiers in recovery.value}
        (committed, (tier1, tier2)), pages = reports[1], _non_grad_pages(job_id)
        assert committed == iteration - 1 and reports[0][0] == iteration - 1, reports
        # every page of the shard rebuilt; most by tier 2 (a tier-1 group that lost all its pages
        # is out of tier 1's reach until tier 2 rebuilt some of them)
        assert sorted(tier1 + tier2) == pages, f"rank 1: tier 1 rebuilt {tier1}, tier 2 {tier2}, pages {pages}"
        assert len(tier2) > len(pages) // 2, f"rank 1: tier 2 rebuilt only {tier2} of {pages}"

        continued = run_job(tmp_path, "continued", retained=True, job_id=job_id, attach=True)
    finally:
        unlink_segments(job_id)
    assert_same_state(plain_fsdp2, continued, "rank 1's shard rebuilt from tier 2")
    for rank in range(WORLD):
        tail = plain_fsdp2[rank]["losses"][iteration * ACCUMULATE:]
        assert all(torch.equal(x, y) for x, y in zip(tail, continued[rank]["losses"], strict=True)), f"rank {rank}"


def _non_grad_pages(job_id: str) -> list[int]:
    """The pages of rank 1's shard that tier 2 stripes (all but the transient gradients)."""
    store = RetainedStore.attach(job_id, 1)
    try:
        return [p for p, kind in enumerate(store.layout.page_kind) if kind != GRAD]
    finally:
        store.close()
