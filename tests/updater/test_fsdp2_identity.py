"""FSDP2 local shards in retained memory, fault-free: bit-identical to plain FSDP2 + torch AdamW.

Two gloo ranks (forked from this process), uneven shards, gradient accumulation, clipping of
the DTensor gradients before the step, and an LR schedule.
"""

from __future__ import annotations

import torch

from leto_lightning import new_job_id
from leto_lightning.retained.shm import unlink_segments

from .conftest import run_job
from .fsdp2_job import ACCUMULATE, MAX_NORM, STEPS


def assert_same_state(plain: list[dict], other: list[dict], what: str) -> None:
    """Local params and AdamW state (step, exp_avg, exp_avg_sq) of every rank, bit for bit."""
    for rank, (a, b) in enumerate(zip(plain, other)):
        for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
            assert torch.equal(x, y), f"{what}: rank {rank}: param {i} differs"
        for i, (x, y) in enumerate(zip(a["state"], b["state"], strict=True)):
            assert set(x) == set(y) == {"step", "exp_avg", "exp_avg_sq"}
            for k in x:
                assert torch.equal(x[k], y[k]), f"{what}: rank {rank}: param {i} state {k} differs"


def test_retained_fsdp2_bit_identical_to_plain_fsdp2(tmp_path, plain_fsdp2):
    job_id = new_job_id()
    try:
        retained = run_job(tmp_path, "retained", retained=True, job_id=job_id)
    finally:
        unlink_segments(job_id)
    assert_same_state(plain_fsdp2, retained, "fault-free")
    for rank, (a, b) in enumerate(zip(plain_fsdp2, retained)):
        assert b["in_store"], f"rank {rank}: a local shard, its gradient or its AdamW state is not a retained view"
        assert b["groups_hold_params"], f"rank {rank}: the optimizer's param groups are not the model's DTensor params"
        assert b["padding_zero"], f"rank {rank}: the padding rows of a retained shard are not zero"
        assert b["iteration"] == STEPS and set(b["versions"]) == {STEPS}, f"rank {rank}: not {STEPS} transactions"
        assert all(n > MAX_NORM for n in a["norms"]), f"rank {rank}: clipping never clipped: {a['norms']}"
        assert all(torch.equal(x, y) for x, y in zip(a["norms"], b["norms"], strict=True)), f"rank {rank}: norms"
        assert len(a["losses"]) == len(b["losses"]) == STEPS * ACCUMULATE
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            assert torch.equal(x, y), f"rank {rank}: loss {i}: {x.item()} != {y.item()}"
    # uneven: rank 1 holds fewer rows of the 5-row and 3-row layers than rank 0
    assert plain_fsdp2[0]["params"][0].shape[0] == 3 and plain_fsdp2[1]["params"][0].shape[0] == 2
    assert retained[0]["n_chunks"] > 1 and len(retained[0]["params"]) == 4


def test_mixed_precision_master_shards_stay_fp32_bit_identical(tmp_path):
    """``MixedPrecisionPolicy(param_dtype=bfloat16)``: forward and backward in bf16, the retained
    master shards and AdamW state fp32, bit-identical to plain FSDP2 with the same policy."""
    plain = run_job(tmp_path, "plain_bf16", bf16=True)
    job_id = new_job_id()
    try:
        retained = run_job(tmp_path, "retained_bf16", retained=True, job_id=job_id, bf16=True)
    finally:
        unlink_segments(job_id)
    assert_same_state(plain, retained, "bf16 compute")
    for rank, (a, b) in enumerate(zip(plain, retained)):
        assert b["in_store"] and b["padding_zero"]
        assert all(p.dtype == torch.float32 for p in b["params"]), f"rank {rank}: master shards not fp32"
        assert all(x.dtype == torch.bfloat16 for x in a["losses"]), "the policy did not compute in bf16"
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)), f"rank {rank}: losses"
