"""A tiny, fully deterministic Lightning job for the integration tests.

Dropout (global RNG), BatchNorm (buffers), a shuffling DistributedSampler (data position
across epochs), clipping, accumulation, LR schedulers and validation: everything a resume
has to restore shows up in the final weights if it is restored wrong.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from leto_lightning.faults.points import set_hook
from leto_lightning.retained.record import ProgressEntry

VOCAB, DIM, SEQ = 23, 16, 6


class TinyModule(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw", scheduler: bool = True, seed: int = 0,
                 loss_file: str | None = None, step_frequency: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.norm = torch.nn.BatchNorm1d(DIM)
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.loss_file = loss_file
        self.step_frequency = step_frequency

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        h = self.norm(self.embed(x).flatten(0, 1))
        logits = self.head(self.drop(torch.nn.functional.gelu(h)))
        return torch.nn.functional.cross_entropy(logits, y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.loss_file:
            with open(self.loss_file, "a") as f:  # the first-hand series, flushed per batch
                f.write(f"{self.current_epoch} {batch_idx} {loss.item().hex()}\n")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
        else:
            opt = {"rmsprop": torch.optim.RMSprop, "nadam": torch.optim.NAdam}[self.optimizer_name](
                self.parameters(), lr=1e-2)
        if not self.use_scheduler:
            return opt
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return [opt], [{"scheduler": warm, "interval": "step", "frequency": self.step_frequency},
                       {"scheduler": decay, "interval": "epoch", "frequency": 1}]


def dataloaders(n: int = 40, batch: int = 4, own_sampler: bool = True) -> tuple[DataLoader, DataLoader]:
    """``own_sampler``: a one-replica shuffling DistributedSampler, so a single-device run and a
    LetoStrategy (DDP) run see the same order; False: Lightning injects one per rank."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    ds = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7) if own_sampler else None
    val = TensorDataset(tokens[:8, :-1], tokens[:8, 1:])
    return DataLoader(ds, batch_size=batch, sampler=sampler), DataLoader(val, batch_size=4)


@dataclass
class RunConfig:
    optimizer: str = "adamw"
    scheduler: bool = True
    max_epochs: int = 3
    accumulate: int = 2
    clip: float | None = 0.5
    precision: str = "32-true"
    val_check_interval: Any = 1.0
    strategy: Any = "auto"  # "auto" (single device), "leto", or a LetoStrategy
    devices: int = 1  # > 1: ranks started by run_ranks (externally, as `leto launch` will)
    seed: int = 0
    loss_file: str | None = None
    ckpt_path: str | None = None
    trainer_kwargs: dict = field(default_factory=dict)
    module: Any = None  # a TinyModule subclass (default TinyModule)


def trainer_for(cfg: RunConfig) -> pl.Trainer:
    kwargs = dict(
        strategy=cfg.strategy, accelerator="cpu", devices=cfg.devices, max_epochs=cfg.max_epochs,
        accumulate_grad_batches=cfg.accumulate, gradient_clip_val=cfg.clip, precision=cfg.precision,
        val_check_interval=cfg.val_check_interval, limit_val_batches=2, num_sanity_val_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**{**kwargs, **cfg.trainer_kwargs})


def fit(cfg: RunConfig) -> dict:
    """Run one fit (in the calling process); returns copies of what the tests compare."""
    # One intra-op thread for every strategy compared here: the single-device strategy keeps torch's
    # default while "ddp" and "leto" set CPUs // processes when OMP_NUM_THREADS is unset (Lightning's
    # launcher convention, checked by the conformance tests); the thread count changes CPU reduction order.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.pop("PL_GLOBAL_SEED", None)
    model = (cfg.module or TinyModule)(cfg.optimizer, cfg.scheduler, cfg.seed, cfg.loss_file)
    trainer = trainer_for(cfg)
    train, val = dataloaders(own_sampler=cfg.devices == 1)
    torch.manual_seed(99)  # the RNG the run starts from (dropout draws from it)
    record = _FinalRecord()
    trainer.callbacks.append(record)
    trainer.fit(model, train, val, ckpt_path=cfg.ckpt_path)
    out = snapshot(trainer, model)
    out["record"] = record.record
    out["callbacks"] = {type(c).__name__: callback_summary(c) for c in trainer.callbacks
                        if type(c).__name__ in ("ModelCheckpoint", "EarlyStopping")}
    return out


class _FinalRecord(pl.Callback):
    """The retained progress record as the fit ends (LetoStrategy; None otherwise): read in
    ``on_train_end``, as a completed fit frees its retained memory right after."""

    def __init__(self) -> None:
        self.record: ProgressEntry | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        retained = getattr(trainer.strategy, "retained", None)
        if retained is not None:
            self.record = retained.store.record.read().progress


def callback_summary(callback: pl.Callback) -> dict:
    """A callback's state with paths reduced to file names (runs may use different dirs)."""
    out = {}
    for key, value in callback.state_dict().items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, str) and os.sep in value:
            value = os.path.basename(value)
        if isinstance(value, dict):
            value = sorted((os.path.basename(k), float(v)) for k, v in value.items())
        if key not in ("dirpath",):
            out[key] = value
    dirpath = getattr(callback, "dirpath", None)
    if dirpath:
        out["files"] = sorted(os.listdir(dirpath))
    return out


def snapshot(trainer: pl.Trainer, model: pl.LightningModule) -> dict:
    opt = trainer.optimizers[0]
    sd = opt.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                  for i, s in sd["state"].items()},
        "lr": [g["lr"] for g in opt.param_groups],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "rng": torch.get_rng_state(),
        "precision": trainer.precision_plugin.state_dict(),  # 16-mixed: the grad scaler's
    }


def differences(a: dict, b: dict) -> list[str]:
    """What is not bit-identical (``torch.equal``) between two snapshots; empty when equal."""
    out = [f"param {n}" for n in b["params"] if not torch.equal(a["params"][n], b["params"][n])]
    out += [f"buffer {n}" for n in b["buffers"] if not torch.equal(a["buffers"][n], b["buffers"][n])]
    for i, s in b["state"].items():
        for k, v in s.items():
            got = a["state"].get(i, {}).get(k)
            same = torch.equal(got, v) if isinstance(v, torch.Tensor) and isinstance(got, torch.Tensor) else got == v
            if not same:
                out.append(f"state {i}.{k}")
    for key in ("lr", "global_step", "epoch", "precision"):
        if a[key] != b[key]:
            out.append(f"{key}: {a[key]} != {b[key]}")
    if not torch.equal(a["rng"], b["rng"]):
        out.append("torch RNG state")
    return out


def read_losses(path: str) -> dict[tuple[int, int], str]:
    out: dict[tuple[int, int], str] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                epoch, idx, value = line.split()
                out[(int(epoch), int(idx))] = value
    return out


def run_ranks(fn: Callable[[int], Any], world: int, timeout: float = 120.0, kill: tuple[int, Any] | None = None,
              allow_failure: bool = False) -> list[Any]:
    """Run ``fn(rank)`` in ``world`` forked processes at once, each with the environment an
    external launcher sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*); returns their results
    (None for a rank that failed, when ``allow_failure``). ``kill=(rank, KillPoint)``: that
    rank SIGKILLs itself at the point."""
    port = _free_port()
    out_dir = tempfile.mkdtemp()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)
                if kill is not None and kill[0] == rank:
                    set_hook(_SelfKill(kill[1]))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                                  RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
                result = fn(rank)
                with open(os.path.join(out_dir, str(rank)), "wb") as f:
                    pickle.dump(result, f)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        while len(codes) < world and time.monotonic() < deadline:
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = status
            time.sleep(0.05)
    finally:
        for pid in pids:
            if pid not in codes:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    if len(codes) < world or (any(codes.values()) and not allow_failure):
        raise RuntimeError(f"ranks failed or timed out: {codes}")
    results = []
    for rank in range(world):
        path = os.path.join(out_dir, str(rank))
        if os.path.exists(path):
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append(None)
    return results


class _SelfKill:
    """Fault hook: SIGKILL this process the ``occurrence``-th time it reaches the point."""

    def __init__(self, kill_at: Any) -> None:
        self.kill_at, self.count = kill_at, 0

    def __call__(self, name: str, context: dict) -> None:
        if name == self.kill_at.name:
            self.count += 1
            if self.count == self.kill_at.occurrence:
                os.kill(os.getpid(), signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
