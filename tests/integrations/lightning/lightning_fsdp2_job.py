"""A tiny Lightning FSDP2 job: ``fully_shard`` in ``configure_model``, 2 gloo ranks on CPU.

Run by forked ranks (``run_lightning_ranks``) under Lightning's ``ModelParallelStrategy`` (the
reference) or ``strategy="leto_fsdp2"``, or as a script under ``leto launch`` (``main``).
Uneven shards (dim 0 of 5 and 3 over 2 ranks), ``accumulate_grad_batches=2``,
``gradient_clip_val`` (norm, small enough that every step clips) and a per-step LR schedule.
Each rank writes what it ends with (local shards, AdamW state, losses) to ``r<rank>.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import leto_lightning  # noqa: F401  registers strategy="leto_fsdp2"

WORLD = 2
ACCUMULATE = 2
CLIP = 0.05
PAGE = dict(page_bytes=64, data_pages=2, tier1_parity=1, tier2_parity=1)


class ShardedTiny(pl.LightningModule):
    def __init__(self, loss_file: str | None = None, bf16: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.loss_file = loss_file
        self.bf16 = bf16

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if self.bf16 else MixedPrecisionPolicy()
        for layer in (self.model[0], self.model[2]):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # the global norm before Lightning clips (max_norm=inf scales by exactly 1.0: nothing changes)
        self.norms.append(torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf")).full_tensor())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch[0]).pow(2).mean()
        self.losses.append(loss.detach().clone())
        if self.loss_file:  # first-hand, flushed per batch: what a killed trainer computed stays
            with open(self.loss_file, "a") as f:
                f.write(f"{self.global_step} {batch_idx} {loss.item().hex()}\n")
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


STEPS_PER_EPOCH = 4


def loader() -> DataLoader:
    """``STEPS_PER_EPOCH`` optimizer steps per epoch and rank (the distributed sampler splits it)."""
    gen = torch.Generator().manual_seed(7)
    data = torch.randn(STEPS_PER_EPOCH * ACCUMULATE * WORLD * 4, 6, generator=gen)
    return DataLoader(TensorDataset(data), batch_size=4)


class Capture(pl.Callback):
    """At the end of the fit (before teardown): local real rows of every param and of its
    AdamW state; for a retained run whether shards and grads are views of the store."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, ShardedTiny)
        params = [p for _, p in pl_module.named_parameters()]
        optimizer = trainer.strategy.optimizers[0]
        sharded = getattr(trainer.strategy, "sharded", None)
        keys = params if sharded is None else [a for g in optimizer.param_groups for a in g["params"]]
        out: dict = {"params": [p.to_local().clone() for p in params], "state": [],
                     "losses": pl_module.losses, "norms": pl_module.norms, "global_step": trainer.global_step,
                     "lr": optimizer.param_groups[0]["lr"]}
        for p, key in zip(params, keys, strict=True):
            rows = p.to_local().shape[0]
            out["state"].append({k: (v.to_local() if hasattr(v, "to_local") else v)[:rows].clone() if v.dim() else
                                 v.clone() for k, v in optimizer.state[key].items()})
        if sharded is not None:
            data = sharded.store.data
            lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
            out["in_store"] = all(lo <= p.to_local().data_ptr() < hi and lo <= p.grad.to_local().data_ptr() < hi
                                  for p in params)
            out["iteration"] = sharded.iteration
        torch.save(out, os.path.join(self.out_dir, f"r{trainer.global_rank}.pt"))


@dataclass(frozen=True)
class LightningJob:
    out_dir: str
    steps: int
    leto: bool
    job_id: str = ""
    port: int = 0
    bf16: bool = False
    save_every: int = 0  # > 0: ModelCheckpoint every N steps into out_dir/ckpt (distributed checkpoints)
    resume_from: str = ""  # fit(ckpt_path=...)


def trainer_for(job: LightningJob) -> pl.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from leto_lightning.integrations.lightning.fsdp2_strategy import LetoModelParallelStrategy

    strategy = (LetoModelParallelStrategy(job_id=job.job_id or None, **PAGE) if job.leto else
                ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1))
    callbacks: list[pl.Callback] = [Capture(job.out_dir)]
    if job.save_every:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(job.out_dir, "ckpt"), filename="{step}",
                                         every_n_train_steps=job.save_every, save_top_k=-1))
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=job.steps,
                      accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, logger=False,
                      enable_checkpointing=bool(job.save_every), enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)


def as_rank(rank: int, port: int) -> None:
    """This process becomes a hand-started rank (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*), as a
    launcher would start it, with one intra-op thread."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    # A forked rank inherits the pytest process's environment: a seed_everything() there (another
    # test) would make Lightning re-seed this rank from PL_GLOBAL_SEED; a launched rank has none.
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)


def train_rank(job: LightningJob, rank: int) -> None:
    as_rank(rank, job.port)
    trainer = trainer_for(job)
    module = ShardedTiny(os.path.join(job.out_dir, f"losses{rank}.txt"), bf16=job.bf16)
    trainer.fit(module, loader(), ckpt_path=job.resume_from or None)
    torch.distributed.destroy_process_group()


def run_lightning_ranks(job: Any, timeout: float = 120.0, train: Any = train_rank) -> dict[int, int]:
    """Fork one child per rank running ``train(job, rank)``; reap every one by pid
    (``fsdp2_job.fork_ranks``). Returns rank -> exit code."""
    from tests.updater.fsdp2_job import fork_ranks

    return fork_ranks(WORLD, lambda rank: train(job, rank), timeout)


def main(argv: list[str] | None = None) -> None:
    """Under ``leto launch``: the same job, ``strategy="leto_fsdp2"`` (the agent owns the store)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    trainer = trainer_for(LightningJob(args.out, args.steps, leto=True))
    module = ShardedTiny(loss_file=os.path.join(args.out, f"losses{rank}.txt"))
    trainer.fit(module, loader())


def loss_series(path: str) -> list[tuple[int, int, str]]:
    """(global step, batch index, loss as hex) per batch, in order, from a ``losses<rank>.txt``
    that every trainer of a rank appended to: a batch a killed trainer computed and its
    successor recomputed must show the same loss, and is kept once."""
    seen: dict[tuple[int, int], str] = {}
    for line in open(path).read().split("\n"):
        if not line:
            continue
        step, batch, value = line.split()
        key = (int(step), int(batch))
        assert seen.setdefault(key, value) == value, f"{path}: batch {key} recomputed as {value}, was {seen[key]}"
    return [(*key, value) for key, value in seen.items()]


if __name__ == "__main__":
    sys.exit(main())
