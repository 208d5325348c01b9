"""ZeRO-1 through ``LetoAccelerator``: a ``ZeroRedundancyOptimizer`` passed to ``prepare()`` trains
bit-identically to a plain ``accelerate.Accelerator`` with the same optimizer (prepared without
device placement: Accelerate's ``state_dict()`` round trip fails on it otherwise); 2 gloo ranks,
forked; a shuffled loader, accumulation 2, ``clip_grad_norm_``, an LR schedule."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from leto_lightning import new_job_id
from leto_lightning.env import JOB_ID
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.testing.launched import free_port
from tests.updater.fsdp2_job import fork_ranks

WORLD = 2
_CLEAR = ("LETO_ROLE", "LETO_RUN_DIR", "LETO_FAULTS", "LETO_RESUME", "LETO_JOB_ID", "TORCHELASTIC_RUN_ID",
          "ACCELERATE_USE_FSDP", "FSDP_VERSION")


def train(out: Path, leto: bool) -> None:
    """One rank: the loop of a plain Accelerate user, with ``LetoAccelerator`` or ``Accelerator``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a state the pytest process or the last run holds
    GradientState._reset_state()

    from leto_lightning.accelerate import LetoAccelerator, LetoConfig

    torch.set_num_threads(1)
    if leto:
        config = LetoConfig(page_bytes=64, data_pages=2, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)
        acc = LetoAccelerator(cpu=True, gradient_accumulation_steps=2, leto=config)
    else:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(zero, lambda s: 1.0 / (1 + 0.1 * s))
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, zero, loader, sched, device_placement=[True, False, True, True])
    losses = []
    for _epoch in range(2):
        for (x,) in loader:
            with acc.accumulate(model):
                loss = model(x).pow(2).mean()
                acc.backward(loss)
                losses.append(loss.detach().clone())
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
                sched.step()
                opt.zero_grad()
    names = {p: n for n, p in acc.unwrap_model(model).named_parameters()}
    result = {"losses": losses, "lr": zero.param_groups[0]["lr"],
              "params": {n: p.detach().clone() for p, n in names.items()},
              "state": {names[p]: {k: v.clone() for k, v in zero.optim.state[p].items()}
                        for g in zero.optim.param_groups for p in g["params"]}}
    if leto:
        data_area = acc.retained.store.data
        lo, hi = data_area.data_ptr(), data_area.data_ptr() + data_area.numel()
        result["binding"] = type(acc.retained).__name__
        result["owned_in_store"] = all(lo <= p.data_ptr() < hi for p in acc.retained.params)
        result["versions"] = sorted(set(acc.retained.store.versions().tolist()))
    torch.save(result, out / f"r{acc.process_index}-{'leto' if leto else 'plain'}.pt")
    acc.end_training()  # frees the retained store (no agent)


def run_forked(out: Path, job: str) -> dict[str, list[dict]]:
    """LetoAccelerator, then a plain Accelerator, in the same forked ranks (one process group)."""
    ports = (free_port(), free_port())

    def rank_main(rank: int) -> None:
        for key in _CLEAR:
            os.environ.pop(key, None)
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                          LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", **{JOB_ID: job})
        for leto, port in zip((True, False), ports, strict=True):  # end_training destroys the process group
            os.environ["MASTER_PORT"] = str(port)
            train(out, leto)

    codes = fork_ranks(WORLD, rank_main, 120)
    assert codes == dict.fromkeys(range(WORLD), 0), f"rank exit codes {codes}"
    return {kind: [torch.load(out / f"r{r}-{kind}.pt") for r in range(WORLD)] for kind in ("leto", "plain")}


def test_leto_accelerator_zero1_bit_identical_to_plain(tmp_path: Path) -> None:
    job = new_job_id()
    try:
        runs = run_forked(tmp_path, job)
    finally:
        unlink_segments(job)
    plain, leto = runs["plain"], runs["leto"]
    for rank in range(WORLD):
        a, b = plain[rank], leto[rank]
        assert b["binding"] == "RetainedZeRO1" and b["owned_in_store"] and b["versions"] == [8], f"rank {rank}: {b}"
        assert a["lr"] == b["lr"]
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)), f"rank {rank}: losses"
        assert [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])] == [], f"rank {rank}"
        assert a["state"].keys() == b["state"].keys() and a["state"], f"rank {rank}"
        for name, st in a["state"].items():
            assert all(torch.equal(v, b["state"][name][k]) for k, v in st.items()), f"rank {rank}: {name}"
