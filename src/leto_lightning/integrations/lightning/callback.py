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

from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from .fit_state import BatchPhase, FitState
from .internals import should_accumulate
from .plateau import allow_epoch_steps
from .resume import capture, capturing, settle_rerun_validation


class RecordingStrategy(Protocol):
    """What the callback needs of ``LetoStrategy`` (a protocol: this module sits below it)."""

    fit_state: FitState

    @property
    def module(self) -> pl.LightningModule: ...

    @property
    def retained_active(self) -> bool: ...

    @property
    def committed_any(self) -> bool: ...

    def record_payload(self, payload: Any) -> None: ...

    def fault_point(self, name: str, phase: str) -> None: ...


class LetoLoopStateCallback(Callback):
    """Re-records the resume payload at the points Lightning can resume from (module doc)."""

    def __init__(self) -> None:
        self._strategy: RecordingStrategy | None = None
        self.records = 0  # payloads this callback wrote (observability, tests)

    def attach(self, strategy: RecordingStrategy) -> None:
        self._strategy = strategy

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy(trainer.callbacks)``, ``torch.save(trainer)``) is detached: it
        records nothing until a strategy attaches it, and holds no retained memory."""
        return dict(self.__dict__, _strategy=None)

    @property
    @override
    def state_key(self) -> str:
        return "LetoLoopStateCallback"

    @override
    def state_dict(self) -> dict[str, Any]:
        """In a checkpoint file: the resume payload as of this save, so that ``fit(ckpt_path=
        <file>)`` with LetoStrategy resumes exactly (RNG, data position, logged rows), not only
        with Lightning's own loop state. Empty inside a payload and outside ``fit``."""
        strategy = self._strategy
        if strategy is None or capturing() or not strategy.retained_active:
            return {}
        trainer = strategy.module.trainer
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return {}
        if strategy.fit_state.batch_open and not batch_processed(trainer):
            # Saved in the middle of a batch (an exception or a signal: OnExceptionCheckpoint):
            # Lightning redoes the batch from its own loop state, and a payload is only ever a
            # batch end or a validation end. The file resumes as a plain Lightning one.
            return {}
        # Inside a training batch (a ModelCheckpoint save in on_train_batch_end): its step
        # metrics are not logged yet; elsewhere (validation, epoch end) they are.
        return {"payload": capture(trainer, "batch_end" if strategy.fit_state.batch_open else "validation_end")}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: ``LetoStrategy.load_checkpoint`` uses the payload."""

    def payload_at_prepare(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The transaction's ``payload_fn``: called at prepare, inside the optimizer step."""
        return capture(trainer, "prepare")

    # -- hooks ---------------------------------------------------------------------------
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        strategy = self._strategy
        if strategy is None or not strategy.retained_active:
            return
        state = strategy.fit_state
        stepped = state.phase is BatchPhase.STEPPED
        skipped = not stepped and step_skipped(trainer, pl_module)
        record = stepped or (skipped and strategy.committed_any)
        state.batch_ended(recorded=record)  # not recorded: an accumulation micro-batch keeps the last record
        if record:
            strategy.record_payload(capture(trainer, "batch_end"))
            self.records += 1

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        strategy = self._strategy
        if strategy is not None and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            strategy.fault_point("lightning.validation", "validation")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._strategy is not None:
            allow_epoch_steps(trainer)  # a resumed fit steps epoch plateau schedulers too
            self._strategy.fault_point("lightning.epoch_end", "epoch_end")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy
        if strategy is None or not strategy.retained_active:
            return
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if strategy.fit_state.take_validation_rerun():
            settle_rerun_validation(trainer)
        if strategy.fit_state.phase is BatchPhase.RECORDED and strategy.committed_any:
            strategy.record_payload(capture(trainer, "validation_end"))
            self.records += 1


def batch_processed(trainer: pl.Trainer) -> bool:
    """Lightning has processed the training batch it started last (its step, if any, is done)."""
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker, typed as its base
    return progress.processed >= progress.started


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
    return pl_module.automatic_optimization and not should_accumulate(trainer)
