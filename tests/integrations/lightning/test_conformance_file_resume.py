"""Conformance of ``fit(ckpt_path=<file>)``: ``"leto"`` against ``"ddp"`` in the same test (issue
25, item 13; the cases of Lightning's own ``test_callbacks_state_fit_ckpt_path`` and
``test_restarting_mid_epoch_raises_warning``).

- Callback state is restored before ``on_fit_start``, as ``"ddp"`` restores it: a callback
  sees the resumed ``ModelCheckpoint`` (best path, score, top-k, last path) there, and every
  callback's ``on_load_checkpoint`` / ``load_state_dict`` runs once.
- A file saved mid-epoch -- after a failed ``fit()``, by ``OnExceptionCheckpoint`` inside the
  failing batch, or by a ``"ddp"`` run -- resumes at the batch Lightning redoes, never skipping
  it, and the resume says what it is: Leto's training loader is resumable, so Lightning's own
  "resuming from a checkpoint that ended before the epoch ended" warning never comes, and
  Leto's takes its place. Without randomness in training, the resumed run ends bit-identical to
  the uninterrupted one (``torch.equal``).

Each strategy runs in one forked child (``devices=1``), every fit of it in turn.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from leto_lightning.testing.crash import run_in_child

STRATEGIES = ("ddp", "leto")
MID_EPOCH = "resuming from a checkpoint that ended"  # what Lightning's test matches
FAIL_AT = 4  # of 8 batches per epoch


class Failure(Exception):
    pass


class Net(pl.LightningModule):
    """No randomness in training: a run resumed at the right batch ends with the same bits."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at = fail_at
        self.seen: list[tuple[int, int, float]] = []  # (epoch, batch_idx, first value of the batch)

    def loss(self, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise Failure()
        self.seen.append((self.current_epoch, batch_idx, float(batch[0][0, 0])))
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Counter(Callback):
    """A callback with state, counting how often the restore reaches it."""

    def __init__(self) -> None:
        self.batches, self.loads, self.on_loads = 0, 0, 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]
        self.loads += 1

    def on_load_checkpoint(self, *args: Any) -> None:
        self.on_loads += 1


class SeenAtFitStart(Callback):
    """What the other callbacks hold when ``on_fit_start`` runs."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = callback_state(trainer)


ATTRIBUTES = ("best_model_path", "best_model_score", "best_k_models", "kth_best_model_path", "kth_value",
              "last_model_path")


def callback_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint callback's resumable attributes (paths relative to their directory) and the counter's."""
    ckpt = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint))
    counter = next(c for c in trainer.callbacks if isinstance(c, Counter))

    def plain(v: Any) -> Any:
        if isinstance(v, str):
            return os.path.basename(v)
        if isinstance(v, dict):
            return {plain(k): plain(x) for k, x in v.items()}
        return copy.deepcopy(v)

    return {**{a: plain(getattr(ckpt, a)) for a in ATTRIBUTES}, "batches": counter.batches}


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(1, keepdim=True)
    train = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    return train, DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4)


def trainer(strategy: str, root: str, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    args = dict(strategy=strategy, accelerator="cpu", devices=1, default_root_dir=root, logger=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    return pl.Trainer(**{**args, **kwargs})


def fit(tr: pl.Trainer, model: Net, **kwargs: Any) -> list[str]:
    """``tr.fit``; returns the warnings about a mid-epoch resume it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tr.fit(model, *loaders(), **kwargs)
        except Failure:
            pass
    return [str(w.message) for w in caught if MID_EPOCH in str(w.message)]


def weights(model: Net) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the workflows, one child per strategy ------------------------------------------------------
def callbacks_workflow(strategy: str, root: str) -> dict:
    """Lightning's test_callbacks_state_fit_ckpt_path, and a stateful callback restored once."""
    def make() -> tuple[pl.Trainer, SeenAtFitStart, Counter]:
        seen, counter = SeenAtFitStart(), Counter()
        checkpoint = ModelCheckpoint(dirpath=root, monitor="val_loss", save_last=True)
        return trainer(strategy, root, [checkpoint, counter, seen], limit_train_batches=3, limit_val_batches=2,
                       max_epochs=1), seen, counter

    tr, _, _ = make()
    fit(tr, Net())
    before = callback_state(tr)
    tr, seen, counter = make()
    fit(tr, Net(), ckpt_path=os.path.join(root, "last.ckpt"))
    return {"before": before, "at_fit_start": seen.seen, "after": callback_state(tr),
            "loads": (counter.loads, counter.on_loads)}


def mid_epoch_workflow(strategy: str, root: str, ddp_root: str | None) -> dict:
    """Straight through; failed mid-epoch and resumed from a file saved after the failed fit
    (Lightning's test), from OnExceptionCheckpoint's file, from an end-of-epoch file; and
    ("leto") from the file the "ddp" run saved after its failed fit."""
    kw = dict(limit_train_batches=8, limit_val_batches=0)
    out: dict[str, Any] = {}
    model = Net()
    fit(trainer(strategy, f"{root}/straight", [], max_epochs=2, **kw), model)
    out["straight"] = {"seen": model.seen, "weights": weights(model)}

    model = Net(fail_at=FAIL_AT)
    tr = trainer(strategy, f"{root}/after", [], max_epochs=1, **kw)
    fit(tr, model)
    first = list(model.seen)
    tr.save_checkpoint(f"{root}/after.ckpt")
    model.fail_at, model.seen = -1, []
    warned = fit(trainer(strategy, f"{root}/after", [], max_epochs=2, **kw), model, ckpt_path=f"{root}/after.ckpt")
    out["after_failure"] = {"seen": first + model.seen, "weights": weights(model), "warned": warned}

    model = Net(fail_at=FAIL_AT)
    fit(trainer(strategy, f"{root}/exc", [OnExceptionCheckpoint(root, "on_exception")], max_epochs=2, **kw), model)
    first = list(model.seen)
    model.fail_at, model.seen = -1, []
    warned = fit(trainer(strategy, f"{root}/exc", [], max_epochs=2, **kw), model, ckpt_path=f"{root}/on_exception.ckpt")
    out["on_exception"] = {"seen": first + model.seen, "weights": weights(model), "warned": warned}

    model = Net()
    tr = trainer(strategy, f"{root}/end", [], max_epochs=1, **kw)
    fit(tr, model)
    tr.save_checkpoint(f"{root}/end.ckpt")
    out["end_of_epoch_warned"] = fit(trainer(strategy, f"{root}/end", [], max_epochs=2, **kw), model,
                                     ckpt_path=f"{root}/end.ckpt")
    if ddp_root is not None:
        out["ddp_file_warned"] = fit(trainer(strategy, f"{root}/from_ddp", [], max_epochs=2, **kw),
                                     Net(), ckpt_path=f"{ddp_root}/after.ckpt")
    return out


@pytest.fixture(scope="module")
def mid_epoch(tmp_path_factory) -> dict[str, dict]:
    out, roots = {}, {s: str(tmp_path_factory.mktemp(s)) for s in STRATEGIES}
    for strategy in STRATEGIES:
        ddp_root = roots["ddp"] if strategy == "leto" else None
        out[strategy] = run_in_child(lambda: mid_epoch_workflow(strategy, roots[strategy], ddp_root), timeout=300).value
    return out


def test_callback_state_before_fit_start_matches_ddp(tmp_path) -> None:
    out = {s: run_in_child(lambda: callbacks_workflow(s, str(tmp_path / s)), timeout=300).value for s in STRATEGIES}
    ddp, leto = out["ddp"], out["leto"]
    assert ddp["before"]["best_model_path"] and ddp["at_fit_start"] == ddp["before"]
    assert leto["at_fit_start"] == ddp["at_fit_start"]  # the file's state, before on_fit_start
    assert leto["after"] == ddp["after"]
    assert leto["loads"] == ddp["loads"] == (1, 1)  # restored once: not again after setup


def test_a_mid_epoch_file_resumes_at_the_batch_lightning_redoes(mid_epoch) -> None:
    """"ddp" (a plain loader) replays the epoch's first batches and Lightning warns; "leto"
    resumes at the failed batch and ends bit-identical to the uninterrupted run."""
    ddp, leto = mid_epoch["ddp"], mid_epoch["leto"]
    assert [s[:2] for s in leto["straight"]["seen"]] == [(e, b) for e in range(2) for b in range(8)]
    for case in ("after_failure", "on_exception"):
        assert leto[case]["seen"] == leto["straight"]["seen"], case
        assert all(torch.equal(leto[case]["weights"][k], v) for k, v in leto["straight"]["weights"].items()), case
        assert ddp[case]["seen"] != ddp["straight"]["seen"], case  # Lightning's unreliable case, for contrast
    assert ddp["after_failure"]["warned"] and "not resumable" in ddp["after_failure"]["warned"][0]


def test_a_mid_epoch_file_resume_says_what_it_does(mid_epoch) -> None:
    """Lightning's warning is replaced by Leto's, which says what the resume does."""
    leto = mid_epoch["leto"]
    for case in ("after_failure", "on_exception"):
        [message] = leto[case]["warned"]
        assert message.startswith("LetoStrategy is resuming from a checkpoint that ended before the epoch ended")
        assert "continues at the next batch" in message and "no Leto resume payload" in message
    assert mid_epoch["ddp"]["end_of_epoch_warned"] == leto["end_of_epoch_warned"] == []
    [message] = leto["ddp_file_warned"]  # a file "ddp" wrote holds no loader position: Lightning's case
    assert "holds no position of the training DataLoader" in message and "unreliable" in message
