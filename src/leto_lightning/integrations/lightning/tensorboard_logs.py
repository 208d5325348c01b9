"""``TensorBoardLogger`` continued across trainer processes without duplicated or missing steps.

TensorBoard's own restart mechanism does the cutting: a ``SummaryWriter(purge_step=N)`` starts
its event file with a ``SessionLog.START`` at step ``N``, and a reader (``EventAccumulator``,
TensorBoard itself) then discards every event it read before with a step >= ``N``. The
resumed process must therefore (1) purge from a step ``N`` such that everything logged after
the resume payload has a step >= ``N``, (2) log again what was logged before the payload at a
step >= ``N`` (the payload carries it, ``tail``), and (3) write its events into a file that
sorts after every older one (readers load a run's files in name order).

- ``N = min(next_step, last_step)``: ``next_step`` is Lightning's logging step when the payload
  is captured (``_batches_that_stepped``), ``last_step`` the largest step logged so far.
  Lightning logs with steps that never decrease -- train metrics and the validation after a
  batch at that batch's step, epoch metrics at the epoch's last step -- so anything logged
  after the payload has a step >= ``N``.
- The events logged before a payload reach the file before the payload is recorded
  (``state`` flushes the writer): a SIGKILL loses nothing that the payload counts as logged.
- Event file names start with the creation time in whole seconds; a resume within the same
  second as an older file's creation could sort before it. Then the older files of that second
  (their writers are dead: SIGKILLed, or shadows that wrote nothing) are renamed to sort just
  before it, keeping their order (``sort_before``).
- ``log_hyperparams`` logs ``hp_metric`` and the hparams summary at step 0 in every process;
  a resumed process skips it unless it purged from step 0 (then the first process's are gone).

Exact for Lightning's own logging; a user logging directly with steps that decrease, or that
run ahead of Lightning's step, can see a step twice or lose one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

from . import internals


class TensorBoardContinuity:
    """Tracks one ``TensorBoardLogger`` on global rank 0 (module doc); ``of`` attaches it once."""

    def __init__(self, logger: TensorBoardLogger) -> None:
        self.logger = logger
        self.last_step: int | None = None
        self.tail: list[tuple[dict, int]] = []  # log_metrics calls at last_step, in order
        self.skip_hparams = False
        self._in_hparams = False
        # Instance attributes that pickle (``torch.save(trainer)``, ``copy.deepcopy``): the class's
        # own functions by name, not closures over the bound methods.
        logger.log_metrics = _Tracked(self, type(logger).log_metrics)  # type: ignore[method-assign]
        logger.log_hyperparams = _Hyperparams(self, type(logger).log_hyperparams)  # type: ignore[method-assign]

    @classmethod
    def of(cls, logger: TensorBoardLogger) -> TensorBoardContinuity:
        keeper = getattr(logger, "_leto_continuity", None)
        if keeper is None:
            keeper = cls(logger)
            # On the logger itself, not in a registry: it must travel with it when the trainer is
            # pickled or copied (its log_metrics wrappers refer to it).
            logger._leto_continuity = keeper  # type: ignore[attr-defined]
        return keeper

    def _track(self, metrics: Any, step: int | None) -> None:
        step = 0 if step is None else int(step)  # SummaryWriter writes a missing step as 0
        if self.last_step is not None and step < self.last_step:
            return  # a decreasing step: cannot be continued exactly (module doc)
        if step != self.last_step:
            self.last_step, self.tail = step, []
        self.tail.append(({k: (v.item() if hasattr(v, "item") else v) for k, v in dict(metrics).items()}, step))

    # -- the resume payload ------------------------------------------------------------------
    def state(self, next_step: int) -> dict[str, Any]:
        """What a process resuming from the payload being captured needs; flushes the writer."""
        experiment = internals.experiment_or_none(self.logger)
        if experiment is not None and hasattr(experiment, "flush"):
            experiment.flush()
        purge = next_step if self.last_step is None else min(next_step, self.last_step)
        tail = list(self.tail) if self.last_step is not None and self.last_step >= purge else []
        return {"purge_step": purge, "tail": tail}

    def resume(self, state: dict[str, Any] | None) -> None:
        """A new writer that purges from the payload's step, then the payload's tail logged again."""
        purge = int(state["purge_step"]) if state else 0
        tail = state["tail"] if state else []
        logger = self.logger
        old = internals.experiment_or_none(logger)
        placeholder = event_file(old) if old is not None else None
        directory = logger.log_dir
        if not any("tfevents" in n and os.path.join(directory, n) != placeholder
                   for n in (os.listdir(directory) if os.path.isdir(directory) else ())):
            return  # a directory of its own (no version given): nothing to continue
        if old is not None:  # created when Lightning set the process up: nothing of the run in it yet
            old.close()
            if placeholder is not None and os.path.isfile(placeholder):
                os.remove(placeholder)
        experiment = internals.new_tensorboard_experiment(logger, purge)  # begins with SessionLog.START at `purge`
        own = event_file(experiment)
        if own is not None:
            sort_before(own)
        self.skip_hparams = purge > 0  # step-0 hparams of the first process are kept
        self.last_step, self.tail = None, []
        for metrics, step in tail:
            logger.log_metrics(metrics, step)
        experiment.flush()


class _Tracked:
    """``logger.log_metrics``: the logger's own, then recorded for the resume payload."""

    def __init__(self, keeper: TensorBoardContinuity, log_metrics: Callable[..., None]) -> None:
        self.keeper, self.log_metrics = keeper, log_metrics

    def __call__(self, metrics: Any, step: int | None = None) -> None:
        keeper = self.keeper
        self.log_metrics(keeper.logger, metrics, step)
        if not keeper._in_hparams:
            keeper._track(metrics, step)


class _Hyperparams:
    """``logger.log_hyperparams``: skipped in a resumed process that keeps the first one's."""

    def __init__(self, keeper: TensorBoardContinuity, log_hyperparams: Callable[..., None]) -> None:
        self.keeper, self.log_hyperparams = keeper, log_hyperparams

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        keeper = self.keeper
        if keeper.skip_hparams:
            return
        keeper._in_hparams = True
        try:
            self.log_hyperparams(keeper.logger, *args, **kwargs)
        finally:
            keeper._in_hparams = False


def event_file(experiment: Any) -> str | None:
    """The event file a ``torch.utils.tensorboard.SummaryWriter`` writes (None if unknown)."""
    return internals.event_file_name(experiment)


def sort_before(own: str) -> list[str]:
    """Make ``own`` (the newest event file) sort last in its directory, the others keeping their
    order. Names are ``events.out.tfevents.<T>.<host>.<pid>.<n>`` (T: the creation second), so a
    file only sorts after ``own`` when it was created in the same second. Then every other file
    of that second (in their order, which is the order they were created in: this runs at every
    resume) becomes ``events.out.tfevents.<T-1>.~leto<i>.<rest>``: after the files of second
    T-1 ('~' sorts after hostname characters) and earlier renamed ones, before every file of
    second T. Returns the new names."""
    directory, name = os.path.split(own)
    events = sorted(n for n in os.listdir(directory) if "tfevents" in n and n != name)
    if not any(n > name for n in events):
        return []
    head, _, rest = name.partition("tfevents.")
    stamp = rest.split(".", 1)[0]
    same = f"{head}tfevents.{stamp}"
    prefix = f"{head}tfevents.{int(stamp) - 1:010d}.~leto"
    taken = [n[len(prefix):].split(".", 1)[0] for n in events if n.startswith(prefix)]
    start = 1 + max((int(i) for i in taken if i.isdigit()), default=-1)
    renamed = []
    for i, old in enumerate((n for n in events if n >= same), start):
        new = f"{prefix}{i:06d}.{old[len(same) + 1:]}"
        os.replace(os.path.join(directory, old), os.path.join(directory, new))
        renamed.append(new)
    return renamed
