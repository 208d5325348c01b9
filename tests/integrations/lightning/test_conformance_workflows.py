"""Conformance: the Lightning workflows people use, run with ``"ddp"`` and with ``"leto"``.

Each workflow runs once per strategy in a forked child (one process, ``devices=1``: none of
them needs two ranks), and the outcomes are compared -- with ``torch.equal`` wherever the
numbers must match: with the same seed, ``"leto"`` is ``"ddp"`` plus protection, so weights,
optimizer state, logged metrics, checkpoint contents and evaluation results are the same bits.

- one automatic-optimization fit with gradient accumulation, validation twice per epoch, a
  per-step cosine schedule, clipping, ``ModelCheckpoint`` (top-k on ``val_loss`` + ``save_last``
  and one every few steps), a ``CSVLogger``, ``LearningRateMonitor``, ``EarlyStopping`` and a
  callback with state of its own;
  then ``trainer.test/validate/predict(ckpt_path="best"/"last")``, ``load_from_checkpoint`` of
  the best file, ``torch.load(weights_only=True)`` of every file, ``Tuner.lr_find``;
- ``fit(ckpt_path=<a mid-epoch checkpoint of that fit>)``: under ``"leto"`` bit-identical to the
  uninterrupted fit (the payload in the file restores RNG and data position), and the same
  loop state as ``"ddp"`` restored from the same file;
- manual optimization with a scheduler stepped by hand.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

from leto_lightning.retained.shm import SEGMENT_PREFIX, list_segments
from leto_lightning.testing.crash import run_in_child

STRATEGIES = ("ddp", "leto")


class Net(pl.LightningModule):
    """LayerNorm, dropout, a cosine schedule: small, but every part a resume must restore."""

    def __init__(self, lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                        torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


class ManualNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt, sched = self.optimizers(), self.lr_schedulers()
        opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5)
        opt.step()
        sched.step()
        self.log("train_loss", loss)
        return loss


class BatchCounter(pl.Callback):
    """A callback with state: saved in every checkpoint, restored by ``fit(ckpt_path=...)``."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 8, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(48, 1, generator=g)
    train = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=4, shuffle=True,
                       generator=torch.Generator().manual_seed(3))
    return train, DataLoader(TensorDataset(x[40:], y[40:]), batch_size=4)


def trainer(strategy: str, root: str, max_epochs: int = 3, **kwargs: Any) -> pl.Trainer:
    callbacks = [ModelCheckpoint(dirpath=f"{root}/best", monitor="val_loss", save_top_k=2, save_last=True),
                 ModelCheckpoint(dirpath=f"{root}/every", every_n_train_steps=3, save_top_k=-1),
                 LearningRateMonitor("step"), BatchCounter(), EarlyStopping("val_loss", patience=100)]
    args = dict(strategy=strategy, accelerator="cpu", devices=1, max_epochs=max_epochs, accumulate_grad_batches=2,
                val_check_interval=0.5, limit_val_batches=2, gradient_clip_val=0.5, log_every_n_steps=1,
                callbacks=callbacks, logger=CSVLogger(root, name="csv", version=0), enable_progress_bar=False,
                enable_model_summary=False)
    return pl.Trainer(**{**args, **kwargs})


def left_in_shm(tr: pl.Trainer) -> list[str]:
    """The segments of the trainer's retained-memory job still in /dev/shm ("ddp": none)."""
    job = getattr(tr.strategy, "job_id", None)
    return list_segments(f"{SEGMENT_PREFIX}{job}-") if job else []


def callback(tr: pl.Trainer, cls: type) -> Any:
    return next(c for c in tr.callbacks if isinstance(c, cls))


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def optimizer_state(trainer: pl.Trainer) -> dict:
    state = trainer.optimizers[0].state_dict()["state"]
    return {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()}


def seeded() -> None:
    # No thread setting of our own: "ddp"'s launcher and Leto's both choose the thread count the
    # same way when OMP_NUM_THREADS is unset (what a user's environment usually is).
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(99)


def automatic_workflow(strategy: str, root: str) -> dict:
    """The automatic-optimization fit and everything done after it (module doc)."""
    seeded()
    model, (train, val) = Net(), loaders()
    tr = trainer(strategy, root)
    tr.fit(model, train, val)
    best = next(c for c in tr.checkpoint_callbacks if c.dirpath.endswith("best"))
    counter = callback(tr, BatchCounter)
    out: dict[str, Any] = {
        "weights": weights(model), "optimizer": optimizer_state(tr), "step": tr.global_step, "counter": counter.batches,
        "best_k": sorted((os.path.basename(k), v.item()) for k, v in best.best_k_models.items()),
        "best": os.path.basename(best.best_model_path), "last": os.path.basename(best.last_model_path),
        "files": sorted(os.path.relpath(p, root) for p in glob.glob(f"{root}/*/*.ckpt")),
        "left_in_shm": left_in_shm(tr),
    }
    with open(f"{root}/csv/version_0/metrics.csv") as f:
        out["metrics.csv"] = f.read()
    files = {}
    for path in sorted(glob.glob(f"{root}/*/*.ckpt")):
        ckpt = torch.load(path, weights_only=True)  # what torch >= 2.6 and Lightning's own reloads do
        # The fit loop's own "state_dict" is its data loaders' state: Leto's training loader is
        # resumable (it records its position), a plain DataLoader saves nothing.
        loader_state = ckpt["loops"]["fit_loop"].pop("state_dict")
        files[os.path.relpath(path, root)] = {"state_dict": ckpt["state_dict"], "global_step": ckpt["global_step"],
                                              "loops": ckpt["loops"], "counter": ckpt["callbacks"]["BatchCounter"],
                                              "early_stopping": next(v for k, v in ckpt["callbacks"].items()
                                                                     if k.startswith("EarlyStopping")),
                                              "loader_state": bool(loader_state)}
    out["checkpoints"] = files
    out["test"] = tr.test(model, val, ckpt_path="best", verbose=False)
    out["validate"] = tr.validate(model, val, ckpt_path="last", verbose=False)
    out["predict"] = torch.cat(tr.predict(model, val, ckpt_path="best"))
    out["loaded"] = weights(Net.load_from_checkpoint(best.best_model_path))
    tuner = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                       default_root_dir=root, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False)
    seeded()
    found = Tuner(tuner).lr_find(Net(), train, val, num_training=12, min_lr=1e-4, max_lr=0.5, early_stop_threshold=None)
    out["lr_find"] = found.results
    out["left_after_all"] = left_in_shm(tr) + left_in_shm(tuner)
    return out


def resumed_workflow(strategy: str, root: str, ckpt: str) -> dict:
    seeded()
    torch.manual_seed(1234)  # a new process: whatever RNG state; a Leto file restores the run's
    model, (train, val) = Net(lr=0.02), loaders()
    tr = trainer(strategy, f"{root}/resumed")
    tr.fit(model, train, val, ckpt_path=ckpt)
    loops = tr.fit_loop.state_dict()
    return {"weights": weights(model), "optimizer": optimizer_state(tr), "step": tr.global_step,
            "counter": callback(tr, BatchCounter).batches, "epoch_progress": loops["epoch_progress"]}


def manual_workflow(strategy: str, root: str) -> dict:
    seeded()
    model, (train, val) = ManualNet(), loaders()
    tr = trainer(strategy, root, max_epochs=2, accumulate_grad_batches=1, gradient_clip_val=None)
    tr.fit(model, train, val)
    with open(f"{root}/csv/version_0/metrics.csv") as f:
        csv = f.read()
    return {"weights": weights(model), "optimizer": optimizer_state(tr), "step": tr.global_step, "metrics.csv": csv}


def same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two outcomes differ (tensors by ``torch.equal``); empty when equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def automatic(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for strategy in STRATEGIES:
        root = str(tmp_path_factory.mktemp(strategy))
        out[strategy] = dict(run_in_child(lambda: automatic_workflow(strategy, root), timeout=300).value, root=root)
    return out


def test_fit_checkpoints_logs_and_evaluation_match_ddp(automatic) -> None:
    ddp, leto = automatic["ddp"], automatic["leto"]
    assert ddp["step"] == 15 and ddp["counter"] == 30  # 40 samples / 4 per batch / 2 accumulated x 3 epochs
    assert len(ddp["files"]) == 8 and ddp["best"] and ddp["last"] == "last.ckpt"
    assert {f["loader_state"] for f in ddp["checkpoints"].values()} == {False}
    assert {f.pop("loader_state") for f in leto["checkpoints"].values()} == {True}
    for f in ddp["checkpoints"].values():
        del f["loader_state"]
    for key in ("weights", "optimizer", "step", "counter", "best_k", "best", "last", "files", "metrics.csv",
                "checkpoints", "test", "validate", "predict", "loaded", "lr_find"):
        assert same(leto[key], ddp[key], key) == [], key
    assert leto["left_in_shm"] == []  # a completed fit frees its retained memory
    assert leto["left_after_all"] == []  # and so do the evaluations and Tuner.lr_find's fit


def test_resume_from_a_leto_checkpoint_file_is_exact(automatic) -> None:
    """A file written during the Leto fit (loaded with weights_only=True inside Lightning and
    LetoStrategy) resumes bit-identical to the uninterrupted fit; "ddp" restores the same loops."""
    ckpt = "every/epoch=1-step=9.ckpt"  # mid-epoch: the epoch's 5 steps end at 10
    out = {}
    for strategy in STRATEGIES:
        root = automatic[strategy]["root"]
        assert ckpt in automatic[strategy]["files"]
        out[strategy] = run_in_child(lambda: resumed_workflow(strategy, root, f"{root}/{ckpt}"), timeout=300).value
    leto, uninterrupted = out["leto"], automatic["leto"]
    assert same(leto["weights"], uninterrupted["weights"], "weights") == []
    assert same(leto["optimizer"], uninterrupted["optimizer"], "optimizer") == []
    assert leto["step"] == uninterrupted["step"] == out["ddp"]["step"] == 15
    assert leto["counter"] == out["ddp"]["counter"]  # the callback's state came back from the file
    assert same(leto["epoch_progress"], out["ddp"]["epoch_progress"], "epoch_progress") == []


def test_manual_optimization_matches_ddp(tmp_path) -> None:
    out = {s: run_in_child(lambda: manual_workflow(s, str(tmp_path / s)), timeout=300).value for s in STRATEGIES}
    assert out["ddp"]["step"] == 20
    assert same(out["leto"], out["ddp"], "manual") == []
