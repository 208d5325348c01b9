"""What ``"leto"`` cannot do as ``"ddp"`` does it is refused at setup, with what to do instead;
everything else here behaves as under ``"ddp"``.

Refused before any retained memory is allocated (no segment of the job appears):
``configure_optimizers()`` returning None, an optimizer whose ``step`` needs its closure (or
calls it other than once), a wrapper optimizer that cannot be rebuilt from its defaults.
As under ``"ddp"``: Lightning's "closure hasn't been executed" guard, ``copy.deepcopy`` of the
callbacks during a fit, ``torch.save(trainer)`` during and after a fit, and a
``TensorBoardLogger`` that Leto continues across processes still pickles.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import TensorBoardLogger
from pl_job import TinyModule, dataloaders

from leto_lightning.errors import ConfigurationError
from leto_lightning.integrations.lightning.tensorboard_logs import TensorBoardContinuity
from leto_lightning.retained.shm import SEGMENT_PREFIX, list_segments
from leto_lightning.testing.crash import run_in_child


class ClosureRequired(torch.optim.SGD):
    """HF-style: ``@torch.no_grad()`` step that calls its closure unconditionally."""

    @torch.no_grad()
    def step(self, closure):  # type: ignore[override]
        with torch.enable_grad():
            closure()
        return super().step()


class IgnoresClosure(torch.optim.RMSprop):
    def step(self, closure=None):  # type: ignore[override]
        return super().step()


class CallsClosureTwice(torch.optim.RMSprop):
    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            with torch.enable_grad():
                closure()
        return super().step(closure)


class SamLike(torch.optim.Optimizer):
    """A wrapper around a base optimizer (as SAM is): not rebuildable from its defaults."""

    def __init__(self, params: Any, base_optimizer: type, **kwargs: Any) -> None:
        super().__init__(params, dict(kwargs))
        self.base = base_optimizer(self.param_groups, **kwargs)

    def step(self, closure=None):  # type: ignore[override]
        return self.base.step(closure)


OPTIMIZERS = {
    "none": (lambda params: None, "configure_optimizers\\(\\) returned None"),
    "closure required": (lambda params: ClosureRequired(params, lr=0.1), "cannot run without a closure"),
    "ignores closure": (lambda params: IgnoresClosure(params, lr=0.01), "never calls its closure"),
    "closure twice": (lambda params: CallsClosureTwice(params, lr=0.01), "calls its closure 2 times"),
    "sam-like": (lambda params: SamLike(params, torch.optim.SGD, lr=0.1), "cannot be rebuilt from its defaults"),
}


class WithOptimizer(TinyModule):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


class SkipsClosure(TinyModule):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step()  # the closure (forward, backward) never runs


class CopiesCallbacks(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            self.copied = [type(c).__name__ for c in copy.deepcopy(trainer.callbacks)]
            buffer = io.BytesIO()
            torch.save(trainer, buffer)
            self.saved = buffer.tell()


def _trainer(strategy: str, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, limit_val_batches=1,
                      num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def test_optimizers_leto_cannot_step_are_refused_at_setup() -> None:
    def child() -> dict:
        out = {}
        for name, (make, _) in OPTIMIZERS.items():
            trainer = _trainer("leto")
            try:
                trainer.fit(WithOptimizer(make), *dataloaders(n=8))
                out[name] = ("trained", trainer.global_step, [])
            except ConfigurationError as exc:
                left = list_segments(f"{SEGMENT_PREFIX}{trainer.strategy.job_id}-") if trainer.strategy.job_id else []
                out[name] = ("refused", str(exc), left)
        return out

    out = run_in_child(child, timeout=300).value
    for name, (_, message) in OPTIMIZERS.items():
        what, text, left = out[name]
        assert what == "refused", (name, out[name])
        assert left == [], (name, left)  # refused before anything was allocated
        assert re.search(message, text), (name, text)
        assert "strategy='ddp'" in text or "manual optimization" in text, text  # says what to do instead


@pytest.mark.parametrize("strategy", ["ddp", "leto"])
def test_closure_guard_copies_and_pickles_as_under_ddp(strategy: str) -> None:
    def child() -> dict:
        guard = _trainer(strategy)
        with pytest.raises(MisconfigurationException, match="The closure hasn't been executed"):
            guard.fit(SkipsClosure(), *dataloaders(n=8))
        copier = CopiesCallbacks()
        trainer = _trainer(strategy, callbacks=[copier])
        trainer.fit(TinyModule(), *dataloaders(n=8))
        after = io.BytesIO()
        torch.save(trainer, after)
        return {"copied": copier.copied, "saved": copier.saved > 0, "after": after.tell() > 0}

    out = run_in_child(child, timeout=300).value
    assert out["saved"] and out["after"]
    assert "CopiesCallbacks" in out["copied"]


def test_a_continued_tensorboard_logger_pickles(tmp_path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    keeper = TensorBoardContinuity.of(logger)
    logger.log_metrics({"loss": 1.5}, step=3)
    copied = pickle.loads(pickle.dumps(logger))
    deep = copy.deepcopy(logger)
    assert keeper.last_step == 3 and keeper.tail == [({"loss": 1.5}, 3)]
    copied.log_metrics({"loss": 1.0}, step=4)  # the copy's own keeper tracks the copy's calls
    assert copied._leto_continuity.last_step == 4 and keeper.last_step == 3
    assert deep._leto_continuity.logger is deep
    logger.finalize("success")
    copied.finalize("success")


def test_the_log_keeper_pickles_without_its_link() -> None:
    """Under ``leto launch`` the strategy's log keeper holds the link to the agent (a session
    with open sockets): a pickled trainer carries what was logged, not the link."""
    import socket

    from leto_lightning.integrations.lightning.logs import LogKeeper
    from leto_lightning.runtime.link import RuntimeLink

    keeper = LogKeeper()
    keeper.rows, keeper.link = {0: 7}, RuntimeLink(1.0)
    with socket.socket() as sock:
        keeper.link.session = sock  # type: ignore[assignment]
        with pytest.raises(TypeError):
            pickle.dumps(keeper.link)
        copied = pickle.loads(pickle.dumps(keeper))
    assert copied.rows == {0: 7} and copied.link is None and keeper.link is not None
