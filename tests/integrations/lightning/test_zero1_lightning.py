"""ZeRO-1 through ``strategy="leto"``: a ``ZeroRedundancyOptimizer`` returned by
``configure_optimizers`` trains bit-identically to Lightning's ``"ddp"`` with the same optimizer
(2 ranks started externally, forked; the tiny job of tests/integrations/lightning: dropout, BatchNorm,
accumulation, clipping, a step and an epoch schedule, validation); and an owner SIGKILLed
between its commit and ZeRO's broadcast, the node's stores rolled forward by ``recover_node``,
both ranks resumed in new processes (other seeds) with ``ckpt_path="leto://retained"``: the
replicas come from the owners, bit-identical to the uninterrupted run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lightning"))  # the shared tiny job
from pl_job import RunConfig, TinyModule, dataloaders, run_ranks, trainer_for

import leto_lightning.integrations.lightning  # noqa: F401  (registers "leto")
from leto_lightning import new_job_id
from leto_lightning.integrations.lightning import RETAINED_CKPT, LetoStrategy
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.zero1 import COMMITTED_POINT

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


def fit_zero(strategy: Any, seed: int, ckpt_path: str | None = None) -> dict:
    torch.set_num_threads(1)
    model = ZeroModule(seed=seed)
    trainer: pl.Trainer = trainer_for(RunConfig(strategy=strategy, seed=seed, **CFG))
    binding = _Binding()
    trainer.callbacks.append(binding)  # type: ignore[attr-defined]
    train, val = dataloaders(own_sampler=False)
    torch.manual_seed(99)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    zero = trainer.optimizers[0]
    names = {p: n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "state": {names[p]: {k: v.clone() for k, v in zero.optim.state[p].items()}
                      for g in zero.optim.param_groups for p in g["params"]},
            "lr": [g["lr"] for g in zero.param_groups], "global_step": trainer.global_step, **binding.seen}


def _leto(job: str) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, tier2_parity=1)


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    return run_ranks(lambda rank: fit_zero("ddp", rank), world=2)


def test_lightning_zero1_bit_identical_to_ddp_with_zero(ddp: list[dict]) -> None:
    job = new_job_id()
    try:
        leto = run_ranks(lambda rank: fit_zero(_leto(job), rank), world=2)
    finally:
        unlink_segments(job)
    for rank in range(2):
        assert leto[rank]["binding"] == "RetainedZeRO1" and leto[rank]["owned_in_store"], f"rank {rank}"
        assert leto[rank]["versions"] == [6], f"rank {rank}: {leto[rank]['versions']}"
        assert_same(ddp[rank], leto[rank], f"rank {rank}")


def test_owner_killed_before_broadcast_resumes_bit_identical(ddp: list[dict]) -> None:
    job = new_job_id()
    try:
        # rank 0 committed iteration 3 (the first step of epoch 2) and dies before ZeRO's broadcast
        crashed = run_ranks(lambda rank: fit_zero(_leto(job), rank), world=2, allow_failure=True, timeout=60,
                            kill=(0, KillPoint(COMMITTED_POINT, 4)))
        assert crashed == [None, None]
        stores = {r: RetainedStore.attach(job, r) for r in range(2)}
        try:
            reports = recover_node(stores)
        finally:
            for store in stores.values():
                store.close()
        assert [reports[r].resume_iteration for r in range(2)] == [4, 4], reports
        resumed = run_ranks(lambda rank: fit_zero(_leto(job), rank + 10, ckpt_path=RETAINED_CKPT), world=2)
    finally:
        unlink_segments(job)
    for rank in range(2):
        assert_same(ddp[rank], resumed[rank], f"rank {rank}")


def assert_same(a: dict, b: dict, what: str) -> None:
    """Bit-identical: params, BatchNorm buffers, the owned AdamW state, LR and step count."""
    assert a["global_step"] == b["global_step"] == 6 and a["lr"] == b["lr"], what
    assert [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])] == [], what
    assert [n for n in a["buffers"] if not torch.equal(a["buffers"][n], b["buffers"][n])] == [], what
    assert a["state"].keys() == b["state"].keys() and a["state"], f"{what} owns {sorted(b['state'])}"
    for name, st in a["state"].items():
        assert all(torch.equal(v, b["state"][name][k]) for k, v in st.items()), f"{what}: {name}"
