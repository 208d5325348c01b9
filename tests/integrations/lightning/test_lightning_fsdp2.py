"""``Trainer(strategy="leto_fsdp2")`` (``LetoModelParallelStrategy``), fault-free: bit-identical
to Lightning's own ``ModelParallelStrategy`` + torch AdamW -- local shards, AdamW state and
every loss -- with uneven shards, ``accumulate_grad_batches``, ``gradient_clip_val`` (a
global norm over the DTensor gradients) and an LR schedule. Two gloo ranks forked from this
process (started by hand: RANK/LOCAL_RANK/WORLD_SIZE), real shared memory.
"""

from __future__ import annotations

import pytest
import torch
from lightning_fsdp2_job import ACCUMULATE, CLIP, WORLD, LightningJob, run_lightning_ranks

from leto_lightning import new_job_id
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.testing.launched import free_port

STEPS = 4


def run(directory, name: str, steps: int = STEPS, **kw) -> list[dict]:
    """``LightningJob(**kw)`` on forked ranks; every rank must end with exit code 0."""
    out = directory / name
    out.mkdir()
    codes = run_lightning_ranks(LightningJob(out_dir=str(out), steps=steps, port=free_port(), **kw))
    assert codes == dict.fromkeys(range(WORLD), 0), f"{name}: rank exit codes {codes}"
    return [torch.load(out / f"r{r}.pt") for r in range(WORLD)]


def assert_identical(plain: list[dict], leto: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(plain, leto)):
        assert b["in_store"], f"rank {rank}: a local shard or its gradient is not a view of the retained store"
        assert b["iteration"] == STEPS == a["global_step"] == b["global_step"]
        assert len(a["losses"]) == len(b["losses"]) == STEPS * ACCUMULATE
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            assert torch.equal(x, y), f"rank {rank}: loss {i}: {x.item()} != {y.item()}"
        assert all(n > CLIP for n in a["norms"]), f"rank {rank}: clipping never clipped: {a['norms']}"
        assert all(torch.equal(x, y) for x, y in zip(a["norms"], b["norms"], strict=True)), f"rank {rank}: norms"
        for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
            assert torch.equal(x, y), f"rank {rank}: param {i} differs"
            assert x.dtype == y.dtype == torch.float32, f"rank {rank}: param {i}: the master shard is not fp32"
        for i, (x, y) in enumerate(zip(a["state"], b["state"], strict=True)):
            assert set(x) == set(y) == {"step", "exp_avg", "exp_avg_sq"}
            for k in x:
                assert torch.equal(x[k], y[k]), f"rank {rank}: param {i} state {k} differs"
        assert a["lr"] == b["lr"] == pytest.approx(0.05 / (1 + STEPS))  # the schedule stepped once per step


def run_pair(tmp_path, **kw) -> tuple[list[dict], list[dict]]:
    plain = run(tmp_path, "plain", leto=False, **kw)
    job_id = new_job_id()
    try:
        leto = run(tmp_path, "leto", leto=True, job_id=job_id, **kw)
    finally:
        unlink_segments(job_id)
    return plain, leto


def test_leto_fsdp2_bit_identical_to_model_parallel_strategy(tmp_path) -> None:
    plain, leto = run_pair(tmp_path)
    assert_identical(plain, leto)
    # uneven: rank 1 holds fewer rows of the 5-row layer than rank 0
    assert plain[0]["params"][0].shape[0] == 3 and plain[1]["params"][0].shape[0] == 2


def test_bf16_policy_master_shards_stay_fp32(tmp_path) -> None:
    """``MixedPrecisionPolicy(param_dtype=bfloat16)`` in ``configure_model``: bf16 compute, fp32
    retained master shards and AdamW state, bit-identical to ``ModelParallelStrategy``."""
    plain, leto = run_pair(tmp_path, bf16=True)
    assert_identical(plain, leto)
    assert all(x.dtype == torch.bfloat16 for x in plain[0]["losses"]), "the policy did not compute in bf16"


def test_checkpoint_restart_from_a_distributed_checkpoint_is_exact(tmp_path) -> None:
    """``ModelCheckpoint`` saves distributed checkpoints from the retained views
    (``ModelParallelStrategy``'s format) mid-epoch; a new job (a new store) resumes with
    ``fit(ckpt_path=...)``, the file loading straight into its retained shards, and continues
    exactly as ``ModelParallelStrategy`` trains without the restart: the same losses from the
    restart on (the Leto payload in the file puts the data position back), shards and state.
    (``ModelParallelStrategy``'s own restart does not: it replays the epoch's first batches.)"""
    first, second = new_job_id(), new_job_id()
    try:
        run(tmp_path, "leto_a", steps=STEPS, leto=True, job_id=first, save_every=2)
        ckpt = tmp_path / "leto_a" / "ckpt" / "step=2.ckpt"
        assert ckpt.is_dir(), sorted(p.name for p in ckpt.parent.iterdir())  # a distributed checkpoint
        restarted = run(tmp_path, "leto_b", steps=STEPS + 2, leto=True, job_id=second, resume_from=str(ckpt))
    finally:
        unlink_segments(first)
        unlink_segments(second)
    whole = run(tmp_path, "plain", steps=STEPS + 2, leto=False)
    for rank, (a, b) in enumerate(zip(whole, restarted)):
        assert a["global_step"] == b["global_step"] == b["iteration"] == STEPS + 2 and b["in_store"]
        after = a["losses"][2 * ACCUMULATE:]  # steps 3.. of the run without a restart
        assert len(b["losses"]) == len(after) == STEPS * ACCUMULATE
        assert all(torch.equal(x, y) for x, y in zip(after, b["losses"], strict=True)), f"rank {rank}: losses"
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)), f"rank {rank}: params"
        for x, y in zip(a["state"], b["state"], strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x), f"rank {rank}: AdamW state"
        assert a["lr"] == b["lr"]
