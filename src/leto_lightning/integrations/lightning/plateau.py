"""``ReduceLROnPlateau`` across a resume: steps Lightning's restart would drop, and their metric.

Lightning steps plateau schedulers outside the places a payload captures, with a metric that no
checkpoint holds (``trainer.callback_metrics``):

- step interval: in the epoch loop's ``on_advance_end``, after the validation due at that batch;
- epoch interval: in the fit loop's ``on_advance_end``, after ``on_train_epoch_end`` -- and
  only ``if not self.restarting``, so Lightning skips it at the first epoch end after any
  restart ("metrics are not saved in the checkpoint").

What LetoStrategy does about it:

- every payload carries the monitored metrics' values (``monitored``), and a resumed fit puts
  them back into ``callback_metrics`` before its first batch;
- a batch-end payload (or a finished prepare payload) whose batch has no validation due keeps
  the plateau steps Lightning still owed after it (``plateau_due``); the restart skips that
  ``on_advance_end``, so ``apply_due`` takes them on resume, with the recorded metric. With a
  validation due, the resume runs it (``resume.resume_into_validation``) and Lightning takes the
  step itself;
- at the resumed epoch's end the loop-state callback clears the fit loop's restart flag
  (``allow_epoch_steps``): the metric is there now, and an uninterrupted run steps there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from .internals import (
    fit_loop_restarting,
    num_ready_batches_reached,
    restore_callback_metrics,
    set_fit_loop_restarting,
    should_accumulate,
)

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl


def monitored(trainer: pl.Trainer) -> dict[str, Any]:
    """The current values of the metrics plateau schedulers monitor (copies)."""
    keys = {c.monitor for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.monitor}
    if not keys:
        return {}
    metrics = trainer.callback_metrics
    return {k: (metrics[k].detach().clone() if isinstance(metrics[k], torch.Tensor) else metrics[k])
            for k in keys if k in metrics}


def plateau_due(trainer: pl.Trainer) -> list[tuple[int, str]]:
    """(scheduler index, interval) of the plateau steps Lightning takes after this batch's end:
    mirrors ``_TrainingEpochLoop._update_learning_rates`` at the two places it runs them."""
    loop = trainer.fit_loop.epoch_loop
    configs = trainer.lr_scheduler_configs
    if not trainer.lightning_module.automatic_optimization:
        return []  # Lightning steps no scheduler in manual optimization
    due: list[tuple[int, str]] = []
    if not should_accumulate(trainer):
        batch = loop.batch_idx + 1
        due += [(i, "step") for i, c in enumerate(configs)
                if c.reduce_on_plateau and c.interval == "step" and batch % c.frequency == 0]
    if num_ready_batches_reached(trainer):
        epoch = trainer.current_epoch + 1
        due += [(i, "epoch") for i, c in enumerate(configs)
                if c.reduce_on_plateau and c.interval == "epoch" and epoch % c.frequency == 0]
    return due


def apply_due(trainer: pl.Trainer, payload: dict[str, Any],
              step_schedulers: Callable[[pl.Trainer, dict[str, Any], list[tuple[int, Any]]], dict[str, Any]]
              ) -> dict[str, Any]:
    """Take the plateau steps a batch-end payload owes (module doc); returns a new payload.
    ``step_schedulers(trainer, out, [(index, metric)])`` steps them on the real schedulers."""
    configs = trainer.lr_scheduler_configs
    steps = []
    for index, _interval in payload["plateau_due"]:
        config = configs[index]
        value = payload.get("monitored", {}).get(config.monitor)
        if value is None:
            if config.strict:
                raise MisconfigurationException(
                    f"ReduceLROnPlateau conditioned on metric {config.monitor}, which the resume payload does not "
                    f"hold (it was not in callback_metrics at the batch end)")
            continue
        steps.append((index, value))
    out = copy.copy(payload)
    out["plateau_due"] = []
    return step_schedulers(trainer, out, steps) if steps else out


def restore_monitored(trainer: pl.Trainer, values: dict[str, Any]) -> None:
    """Put a payload's monitored metrics back into ``callback_metrics`` (a resumed fit)."""
    if values:
        restore_callback_metrics(trainer, values)


def allow_epoch_steps(trainer: pl.Trainer) -> None:
    """At ``on_train_epoch_end`` of a resumed fit: let Lightning step epoch-interval plateau
    schedulers, as it does in an uninterrupted run (module doc)."""
    if fit_loop_restarting(trainer) and any(
            c.reduce_on_plateau and c.interval == "epoch" for c in trainer.lr_scheduler_configs):
        set_fit_loop_restarting(trainer, False)
