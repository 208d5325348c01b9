"""ZeRO-1 through ``strategy="leto"``: a ``ZeroRedundancyOptimizer`` returned by
``configure_optimizers`` trains bit-identically to Lightning's ``"ddp"`` with the same optimizer
(2 ranks started externally, forked; the tiny job of tests/lightning: dropout, BatchNorm,
accumulation, clipping, a step and an epoch schedule, validation)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lightning"))  # the shared tiny job
from pl_job import RunConfig, TinyModule, dataloaders, run_ranks, trainer_for

import leto_lightning.integrations.lightning  # noqa: F401  (registers "leto")
from leto_lightning.integrations.lightning import LetoStrategy
from leto_lightning.retained.shm import new_job_id, unlink_segments

CFG = dict(devices=2, max_epochs=2)


class ZeroModule(TinyModule):
    def configure_optimizers(self) -> Any:
        opt = ZeroRedundancyOptimizer(self.parameters(), torch.optim.AdamW, lr=3e-2, betas=(0.9, 0.95),
                                      weight_decay=0.1)
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return [opt], [{"scheduler": warm, "interval": "step"}, {"scheduler": decay, "interval": "epoch"}]


class _Binding(pl.Callback):
    """As the fit ends (before a completed fit frees its store): what holds the owned params."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ro = getattr(trainer.strategy, "retained", None)
        if ro is not None:
            data = ro.store.data
            lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
            self.seen = {"binding": type(ro).__name__, "versions": sorted(set(ro.store.versions().tolist())),
                         "owned_in_store": all(lo <= p.data_ptr() < hi for p in ro.params) and bool(ro.params)}


def fit_zero(strategy: Any, seed: int) -> dict:
    torch.set_num_threads(1)
    model = ZeroModule(seed=seed)
    trainer: pl.Trainer = trainer_for(RunConfig(strategy=strategy, seed=seed, **CFG))
    binding = _Binding()
    trainer.callbacks.append(binding)  # type: ignore[attr-defined]
    train, val = dataloaders(own_sampler=False)
    torch.manual_seed(99)
    trainer.fit(model, train, val)
    zero = trainer.optimizers[0]
    names = {p: n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "state": {names[p]: {k: v.clone() for k, v in zero.optim.state[p].items()}
                      for g in zero.optim.param_groups for p in g["params"]},
            "lr": [g["lr"] for g in zero.param_groups], "global_step": trainer.global_step, **binding.seen}


def test_lightning_zero1_bit_identical_to_ddp_with_zero() -> None:
    job = new_job_id()
    try:
        leto = run_ranks(lambda rank: fit_zero(LetoStrategy(job_id=job, page_bytes=512, tier2_parity=1), rank),
                         world=2)
    finally:
        unlink_segments(job)
    ddp = run_ranks(lambda rank: fit_zero("ddp", rank), world=2)
    for rank in range(2):
        a, b = ddp[rank], leto[rank]
        assert a["global_step"] == b["global_step"] == 6 and a["lr"] == b["lr"]
        assert b["binding"] == "RetainedZeRO1" and b["owned_in_store"] and b["versions"] == [6], f"rank {rank}: {b}"
        assert [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])] == [], f"rank {rank}"
        assert [n for n in a["buffers"] if not torch.equal(a["buffers"][n], b["buffers"][n])] == [], f"rank {rank}"
        assert a["state"].keys() == b["state"].keys() and a["state"], f"rank {rank} owns {sorted(b['state'])}"
        for name, st in a["state"].items():
            assert all(torch.equal(v, b["state"][name][k]) for k, v in st.items()), f"rank {rank} {name}"
