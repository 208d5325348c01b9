"""A HOF under FSDP2: one rank's trainer SIGKILLed in the middle of its chunk transactions (the
other rank is then SIGKILLed wherever it is, as its peer is gone), the node's retained shards
rolled forward by ``updater.recovery.recover_node`` in a separate process, and new trainers that
re-bind to the same stores continue: bit-identical to the fault-free run.
"""

from __future__ import annotations

import signal

import pytest
import torch

from leto_lightning.retained.shm import new_job_id, unlink_segments
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import run_in_child
from leto_lightning.updater.recovery import recover_node

from .conftest import run_job
from .fsdp2_job import ACCUMULATE, STEPS, WORLD, Job, run_ranks
from .test_fsdp2_identity import assert_same_state

CHUNKS = 3  # per rank and iteration (the layout of the job's shards)


def _recover(job_id: str) -> list[tuple[int, str, int, list[int]]]:
    stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
    try:
        reports = recover_node(stores)
        return [(r.rank, str(r.status_found), r.committed_iteration, r.rolled_forward) for r in reports.values()]
    finally:
        for store in stores.values():
            store.close()


@pytest.mark.parametrize(("point", "iteration", "chunk"), [
    ("chunk.undo_copied", 0, 0), ("chunk.tier2_done", 1, 2), ("chunk.math_done", 2, 1)])
def test_rank_killed_mid_update_rolls_forward_bit_identical(tmp_path, plain_fsdp2, point, iteration, chunk):
    job_id = new_job_id()
    try:
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        codes = run_ranks(Job(rendezvous=str(tmp_path / "crashed.rdzv"), out_dir=str(crashed), steps=STEPS,
                              retained=True, job_id=job_id, kill_rank=1, kill_point=point,
                              kill_at=iteration * CHUNKS + chunk + 1))
        assert codes[1] == -signal.SIGKILL, f"rank 1 was not killed at {point}: exit codes {codes}"
        assert codes[0] != 0, "rank 0 finished although its peer died"

        recovery = run_in_child(lambda: _recover(job_id), timeout=60)
        assert recovery.exit_code == 0, recovery
        reports = {rank: (status, committed, rolled) for rank, status, committed, rolled in recovery.value}
        status, committed, rolled = reports[1]
        assert status == "prepared" and committed == iteration and rolled, f"rank 1: {reports[1]}"
        assert reports[0][1] == iteration, f"rank 0 resumes elsewhere: {reports[0]}"

        continued = run_job(tmp_path, "continued", retained=True, job_id=job_id, attach=True)
    finally:
        unlink_segments(job_id)
    assert_same_state(plain_fsdp2, continued, f"killed at {point} of iteration {iteration}")
    for rank in range(WORLD):
        tail = plain_fsdp2[rank]["losses"][(iteration + 1) * ACCUMULATE:]
        assert len(continued[rank]["losses"]) == len(tail) > 0
        assert all(torch.equal(x, y) for x, y in zip(tail, continued[rank]["losses"])), f"rank {rank}: losses"
        assert continued[rank]["in_store"] and continued[rank]["padding_zero"]
        assert set(continued[rank]["versions"]) == {STEPS}
