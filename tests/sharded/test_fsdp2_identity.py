"""FSDP2 local shards in retained memory, fault-free: bit-identical to plain FSDP2 + torch AdamW.

Two gloo ranks (forked from this process), uneven shards, gradient accumulation, clipping of
the DTensor gradients before the step, and an LR schedule.
"""

from __future__ import annotations

import torch

from leto_lightning.retained.shm import new_job_id, unlink_segments

from .fsdp2_job import WORLD, Job, run_ranks


def _run(tmp_path, name: str, **kw) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    job = Job(rendezvous=str(tmp_path / f"{name}.rdzv"), out_dir=str(out), steps=4, **kw)
    codes = run_ranks(job)
    assert codes == dict.fromkeys(range(WORLD), 0), f"{name}: rank exit codes {codes}"
    return [torch.load(out / f"r{r}.pt") for r in range(WORLD)]


def test_retained_fsdp2_bit_identical_to_plain_fsdp2(tmp_path):
    plain = _run(tmp_path, "plain")
    job_id = new_job_id()
    try:
        retained = _run(tmp_path, "retained", retained=True, job_id=job_id)
    finally:
        unlink_segments(job_id)
    for rank, (a, b) in enumerate(zip(plain, retained)):
        assert b["in_store"], f"rank {rank}: a local shard or its gradient is not a view of the retained store"
        assert b["padding_zero"], f"rank {rank}: the padding rows of a retained shard are not zero"
        assert b["iteration"] == 4 and set(b["versions"]) == {4}, f"rank {rank}: not 4 chunk transactions"
        assert all(n > 0.05 for n in a["norms"]), f"rank {rank}: clipping never clipped: {a['norms']}"
        assert all(torch.equal(x, y) for x, y in zip(a["norms"], b["norms"])), f"rank {rank}: grad norms differ"
        assert len(a["losses"]) == len(b["losses"]) == 8
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            assert torch.equal(x, y), f"rank {rank}: loss {i}: {x.item()} != {y.item()}"
        for i, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert torch.equal(x, y), f"rank {rank}: param {i} differs"
        for i, (x, y) in enumerate(zip(a["state"], b["state"])):
            assert set(x) == set(y) == {"step", "exp_avg", "exp_avg_sq"}
            for k in x:
                assert torch.equal(x[k].float(), y[k].float()), f"rank {rank}: param {i} state {k} differs"
    # uneven: rank 1 holds fewer rows of the 5-row and 3-row layers than rank 0
    assert plain[0]["params"][0].shape[0] == 3 and plain[1]["params"][0].shape[0] == 2
