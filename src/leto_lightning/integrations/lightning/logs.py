"""Loggers across the processes of one ``leto launch`` job.

After a recovery a *different process* (the promoted shadow, or a cold restart) continues the
run. Left alone, Lightning's loggers would not follow it:

- ``CSVLogger``/``TensorBoardLogger`` pick the next free ``version_N`` directory when their
  version is not given, so every process would log into its own directory. The first active
  rank 0 of the job publishes the version it resolved (the agent's store); every later
  process takes it.
- ``CSVLogger`` *deletes* ``metrics.csv`` when its writer is created over a non-empty
  directory -- a shadow pre-initialising would erase the active trainer's log. A resuming
  process gets a writer that keeps the file; once resumed, the file is cut back to the rows
  the resume payload counted, and later rows (logged after the payload the run resumes from)
  are logged again by the resumed run, with the same values.
- The batch whose update committed just before a crash is not recomputed, so its step
  metrics would never reach the loggers (Lightning feeds them after ``on_train_batch_end``).
  Payloads captured at prepare or at batch end carry them; the resumed run logs them first.

Recovery metrics (``recovery_metrics.py``) are logged by global rank 0 at the start of
training batches; which recoveries were logged is part of the payload too, so each recovery
is logged once per metrics file.

- ``TensorBoardLogger`` writes a new event file per process; a resuming one purges from the
  payload's step (TensorBoard's ``purge_step``) and logs again what the payload says was logged
  at or after it (``tensorboard_logs.py``).

Logged *through this module*: ``CSVLogger`` and ``TensorBoardLogger`` (continued exactly) and
any other logger (``WandbLogger``: every process writes its own run, all in one wandb group
named after the run directory (unless the logger names a group); the recovery metrics are in
the run of the process that logged them).

Without ``leto launch`` (``fit(ckpt_path="leto://retained")`` or a checkpoint file in a new
process) the same applies to loggers whose ``version`` is given; there is no agent to agree
on a version, and no recovery metrics.
"""

from __future__ import annotations

import csv
import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from ...console import say
from ...env import RESUME, ResumeMode
from . import internals
from .recovery_metrics import EventReader, finished_recoveries, metrics_for, recoveries_open, summary_table
from .tensorboard_logs import TensorBoardContinuity

if TYPE_CHECKING:  # pragma: no cover
    from ...runtime.link import RuntimeLink

VERSION_KEY = "lightning/logger{index}/version"
CKPT_STEP_KEY = "lightning/newest_checkpoint_step"
WANDB_FLUSH_ENV = "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"  # wandb's x_transaction_log_flush_interval
WANDB_FLUSH_S = 1.0
_COUNTING: weakref.WeakSet[Callable[..., None]] = weakref.WeakSet()  # row-counting wrappers of CSVLogger.log_metrics


def wandb_group(run_dir: str) -> str:
    """The wandb group of a ``leto launch`` job's runs: ``leto-<run dir name>``."""
    return "leto-" + os.path.basename(os.path.abspath(run_dir))


class LogKeeper:
    """Keeps the loggers of one ``fit()`` continuous across trainer processes (module doc)."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}  # CSVLogger index in trainer.loggers -> rows in its metrics.csv
        self.logged_recoveries: set[int] = set()  # generations whose recovery metrics were logged
        self.recovered_total = 0
        self.reader: EventReader | None = None
        self.pending: dict | None = None  # step metrics of the resumed batch, still to be logged
        self.ckpt_step = 0  # global step of the newest checkpoint file when this process resumed
        # at on_train_start: (retained iteration, global step, newest checkpoint's global step)
        self.start: tuple[int | None, int, int] = (None, 0, 0)
        self.link: RuntimeLink | None = None
        self.kept: set[int] = set()  # CSVLoggers whose file this process continues (not recreates)
        self.tensorboard: dict[int, TensorBoardContinuity] = {}  # TensorBoardLogger index -> its keeper
        self.tb_kept: set[int] = set()  # TensorBoardLoggers this process continues
        self.active = False

    def __getstate__(self) -> dict[str, Any]:
        """A pickled copy (``torch.save(trainer)``) keeps what was logged, not this process's
        link to ``leto launch`` or its open event reader."""
        return dict(self.__dict__, link=None, reader=None)

    # -- before Lightning creates the loggers' experiments (setup_environment) --------------
    def prepare(self, trainer: pl.Trainer, link: RuntimeLink | None, rank: int, continues: bool = False) -> None:
        """``link``: under ``leto launch``; without it, ``continues`` says whether this fit resumes
        (from retained memory or a checkpoint file)."""
        self.active = True
        self.link = link
        resumes = link is not None and link.resumes
        if link is not None:  # the logs go on from a payload
            continues = resumes or os.environ.get(RESUME) == ResumeMode.CHECKPOINT
        logger: Any  # Lightning's loggers: their private version, experiment and wandb.init arguments (internals)
        for index, logger in enumerate(trainer.loggers):
            if link is not None and internals.version_unset(logger):
                key = VERSION_KEY.format(index=index)
                if rank == 0 and not resumes:
                    value = link.publish_once(key, str(logger.version))
                else:
                    value = link.wait_value(key)
                internals.set_version(logger, int(value) if value.isdigit() else value)
            if (link is not None and type(logger).__name__ == "WandbLogger"
                    and internals.experiment_or_none(logger) is None):
                # Trainers die by SIGKILL here by design (every HOF stops every active trainer):
                # wandb's default 15 s between writes of its run file would lose that much history.
                os.environ.setdefault(WANDB_FLUSH_ENV, str(WANDB_FLUSH_S))
                # One wandb run per trainer process: grouped, so the job reads as one in the UI.
                init = internals.wandb_init_kwargs(logger)
                if init.get("group") is None:
                    init["group"] = wandb_group(link.run_dir)
            if isinstance(logger, CSVLogger) and rank == 0:
                self._count_rows(index, logger)
                if continues and internals.experiment_or_none(logger) is None:
                    internals.set_experiment(logger, internals.csv_writer_keeping_file(logger.log_dir))
                    self.kept.add(index)
            if isinstance(logger, TensorBoardLogger) and rank == 0:
                self.tensorboard[index] = TensorBoardContinuity.of(logger)
                if continues:
                    self.tb_kept.add(index)
        if rank == 0 and link is not None:
            self.reader = EventReader(link.run_dir)

    def _count_rows(self, index: int, logger: CSVLogger) -> None:
        self.rows.setdefault(index, 0)
        if logger.log_metrics in _COUNTING:  # wrapped once already (the mark is on our wrapper, not the logger)
            return
        log_metrics = logger.log_metrics

        def counted(metrics: dict, step: int | None = None) -> None:
            log_metrics(metrics, step)
            self.rows[index] = self.rows.get(index, 0) + 1

        _COUNTING.add(counted)
        logger.log_metrics = counted  # type: ignore[method-assign]  # an instance attribute over the method

    # -- the resume payload ----------------------------------------------------------------
    def state(self, trainer: pl.Trainer, kind: str) -> dict[str, Any] | None:
        if not self.active:
            return None
        step = internals.batches_that_stepped(trainer)
        return {"csv_rows": dict(self.rows), "recoveries": sorted(self.logged_recoveries),
                "recovered": self.recovered_total, "ckpt_step": self._newest_checkpoint(trainer),
                "tensorboard": {i: tb.state(step) for i, tb in self.tensorboard.items()},
                "pending": pending_step_metrics(trainer) if kind in ("prepare", "batch_end") else None}

    def continue_from(self, trainer: pl.Trainer, payload: Any) -> None:
        """A resumed process (or a restart from a checkpoint file): cut the continued CSV files
        back to the payload's rows (none without a payload), purge the TensorBoard logs from the
        payload's step, remember what was logged."""
        if not self.active:
            return
        logs = (payload or {}).get("logs") or {}
        rows = logs.get("csv_rows", {})
        for index in sorted(self.kept):
            csv_logger: Any = trainer.loggers[index]  # a CSVLogger (kept holds only those)
            self.rows[index] = _truncate(csv_logger.experiment, rows.get(index, 0))
        self.kept.clear()
        boards = logs.get("tensorboard", {})
        for index in sorted(self.tb_kept):
            self.tensorboard[index].resume(boards.get(index))
        self.tb_kept.clear()
        self.logged_recoveries = set(logs.get("recoveries", []))
        self.recovered_total = int(logs.get("recovered", 0))
        self.ckpt_step = int(logs.get("ckpt_step", 0))  # ModelCheckpoint does not restore its own
        self.pending = logs.get("pending")

    def on_train_start(self, trainer: pl.Trainer, iteration: int | None = None) -> None:
        """Log the step metrics the predecessor never logged; note the newest checkpoint and
        where this process starts (retained ``iteration``, Lightning's global step)."""
        if not self.active:
            return
        self.ckpt_step = self._newest_checkpoint(trainer, ask_job=True)
        self.start = (iteration, trainer.global_step, self.ckpt_step)  # the kept steps count from here
        pending, self.pending = self.pending, None
        if pending:
            metrics = dict(pending["metrics"], epoch=pending["epoch"])
            internals.log_metrics(trainer, metrics, step=pending["step"])

    # -- recovery metrics --------------------------------------------------------------------
    def log_recoveries(self, trainer: pl.Trainer) -> int:
        """Log the recoveries the agent finished since the last call (global rank 0)."""
        if self.reader is None:
            return 0
        self.reader.poll()
        logged = 0
        for event in finished_recoveries(self.reader.events):
            if event.generation in self.logged_recoveries:
                continue
            resume_step = self._global_step_of(int(event.resume_iteration or 0))
            kept = max(0, resume_step - self.start[2])
            metrics = metrics_for(event, self.reader.events, kept, self.recovered_total)
            metrics["leto/recovery/resume_step"] = float(resume_step)
            step = internals.batches_that_stepped(trainer)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()
            self.logged_recoveries.add(event.generation)
            self.recovered_total += kept
            logged += 1
        return logged

    def checkpoint_saved(self, link: RuntimeLink, step: int) -> None:
        """A checkpoint file of ``step`` is on disk: tell the job (its store), so a trainer that
        resumes from a payload older than the file still knows it (the recovery metrics)."""
        link.set_value(CKPT_STEP_KEY, str(step))
        self.ckpt_step = max(self.ckpt_step, step)

    def _newest_checkpoint(self, trainer: pl.Trainer, ask_job: bool = False) -> int:
        """The global step of the newest checkpoint file: the callbacks' own, the payload's
        (ModelCheckpoint does not restore it), and with ``ask_job`` the job's store (under
        ``leto launch``: a file saved after the payload this process resumed from)."""
        steps = [internals.last_global_step_saved(cb) for cb in trainer.checkpoint_callbacks]
        published = self.link.get_value(CKPT_STEP_KEY) if ask_job and self.link is not None else None
        return max([self.ckpt_step, *steps, int(published or 0)])

    def _global_step_of(self, iteration: int) -> int:
        """The agent counts retained iterations, checkpoints count global steps: they differ by
        the steps 16-mixed's scaler skipped. Exact for the recovery this process resumed from."""
        mine, step, _ = self.start
        return step if iteration == mine else iteration

    def finish(self, trainer: pl.Trainer, wait_s: float = 5.0) -> str | None:
        """End of ``fit()`` on global rank 0: log what is left and print the summary table."""
        if self.reader is None:
            return None
        deadline = time.time() + wait_s
        while True:  # the last recovery's books close once every rank finished a step after it
            self.reader.poll()
            if not recoveries_open(self.reader.events) or time.time() > deadline:
                break
            time.sleep(0.05)
        self.log_recoveries(trainer)
        table = summary_table(self.reader.events, now=time.time())
        say(table)  # the user-facing summary of the job's recoveries
        return table


def pending_step_metrics(trainer: pl.Trainer) -> dict[str, Any] | None:
    """What ``update_train_step_metrics`` will log after this batch (None: nothing)."""
    metrics = internals.step_metrics_due(trainer)
    if not metrics:
        return None
    return {"metrics": {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()},
            "step": internals.batches_that_stepped(trainer), "epoch": trainer.current_epoch}


def _truncate(writer: Any, rows: int) -> int:
    """Keep the header and the first ``rows`` rows of the writer's file; returns the rows kept."""
    path = writer.metrics_file_path
    writer.metrics = []
    if not os.path.isfile(path):
        writer.metrics_keys = []
        return 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        kept = [row for _, row in zip(range(rows), reader)]
    tmp = path + ".leto-tmp"
    with open(tmp, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=header)
        out.writeheader()
        out.writerows(kept)
    os.replace(tmp, path)
    writer.metrics_keys = sorted(header)
    return len(kept)
