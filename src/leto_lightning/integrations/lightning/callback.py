"""``LetoLoopStateCallback``: keeps the retained progress record's resume payload current.

The optimizer-step transaction records a payload at *prepare* (``resume.capture(kind=
"prepare")``, finished on resume by ``resume.finish_batch``). This callback re-records, for
the same committed iteration, a payload captured where Lightning itself would checkpoint:

- ``on_train_batch_end`` of a batch whose optimizer step committed: the exact state inside that
  hook, including what earlier callbacks did in it (e.g. ``ModelCheckpoint``'s
  ``every_n_train_steps`` save) -- this callback runs last;
- ``on_validation_end`` inside ``fit``, when no gradient-accumulation micro-batch ran since the
  last committed step: the state after validation (``ModelCheckpoint``/``EarlyStopping``
  updates, the RNG after the validation loader), where ``ModelCheckpoint`` saves by default.

After a step the grad scaler skipped (16-mixed, inf/nan gradients: no transaction ran) the
batch end is re-recorded too, once something was committed (``step_skipped``).

Why never after a micro-batch without a step: its gradients sit unprotected in retained
memory; resuming after it would build on gradients a crash may have torn. Resuming from the
last committed step recomputes the micro-batch instead.

``LetoStrategy`` attaches one automatically (last in ``trainer.callbacks``); adding it
yourself is allowed, the strategy moves it to the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from . import plateau
from .resume import capture, capturing, settle_rerun_validation

if TYPE_CHECKING:  # pragma: no cover
    from .strategy import LetoStrategy


class LetoLoopStateCallback(Callback):
    """Re-records the resume payload at the points Lightning can resume from (module doc)."""

    def __init__(self) -> None:
        self._strategy: LetoStrategy | None = None
        self.records = 0  # payloads this callback wrote (observability, tests)

    def attach(self, strategy: LetoStrategy) -> None:
        self._strategy = strategy

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy(trainer.callbacks)``, ``torch.save(trainer)``) is detached: it
        records nothing until a strategy attaches it, and holds no retained memory."""
        return dict(self.__dict__, _strategy=None)

    @property
    def state_key(self) -> str:
        return "LetoLoopStateCallback"

    def state_dict(self) -> dict[str, Any]:
        """In a checkpoint file: the resume payload as of this save, so that ``fit(ckpt_path=
        <file>)`` with LetoStrategy resumes exactly (RNG, data position, logged rows), not only
        with Lightning's own loop state. Empty inside a payload and outside ``fit``."""
        strategy = self._strategy
        if strategy is None or capturing() or not strategy.retained_active:
            return {}
        trainer = strategy.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return {}
        # Inside a training batch (a ModelCheckpoint save in on_train_batch_end): its step
        # metrics are not logged yet; elsewhere (validation, epoch end) they are.
        return {"payload": capture(trainer, "batch_end" if strategy.batch_open else "validation_end")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: ``LetoStrategy.load_checkpoint`` uses the payload."""

    def payload_at_prepare(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The transaction's ``payload_fn``: called at prepare, inside the optimizer step."""
        return capture(trainer, "prepare")

    # -- hooks ---------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        strategy = self._strategy
        if strategy is None or not strategy.retained_active:
            return
        strategy.batch_open = False
        skipped = not strategy.stepped_in_batch and step_skipped(trainer, pl_module)
        if strategy.stepped_in_batch or (skipped and strategy.committed_any):
            strategy.record_payload(capture(trainer, "batch_end"))
            self.records += 1
            strategy.clean_since_step = True
        else:
            strategy.clean_since_step = False  # an accumulation micro-batch: keep the last record

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        strategy = self._strategy
        if strategy is not None and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            strategy.fault_point("lightning.validation", "validation")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._strategy is not None:
            plateau.allow_epoch_steps(trainer)  # a resumed fit steps epoch plateau schedulers too
            self._strategy.fault_point("lightning.epoch_end", "epoch_end")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy
        if strategy is None or not strategy.retained_active:
            return
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if strategy.rerunning_validation:
            strategy.rerunning_validation = False
            settle_rerun_validation(trainer)
        if strategy.clean_since_step and strategy.committed_any:
            strategy.record_payload(capture(trainer, "validation_end"))
            self.records += 1


def step_skipped(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """This batch ended an accumulation window, yet no transaction ran: 16-mixed's grad scaler
    found inf/nan gradients and skipped ``optimizer.step`` (or ``training_step`` returned None).

    Weights and optimizer state are still the last commit's, and Lightning finished the batch
    (the step counter, the LR schedulers, the scaler's back-off): the batch end is a point
    Lightning itself checkpoints at, so it is re-recorded for the last committed iteration --
    a crash after it does not recompute the skipped batches. Not before the first commit: the
    ``"start"`` payload stays, and a resume recomputes those batches deterministically.

    Gradients that replaced the retained views since the last step (``zero_grad(set_to_none=
    True)`` before validation) were not adopted, as no step ran: the next window's
    ``RetainedOptimizer.zero_grad`` points the params back at their zeroed views.
    """
    return pl_module.automatic_optimization and not trainer.fit_loop._should_accumulate()
