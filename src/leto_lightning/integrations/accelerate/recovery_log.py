"""Recovery metrics through Accelerate's trackers, one run (or wandb group) per job.

Under a Leto agent, the main process reads the agent's ``events.jsonl`` (the Lightning
integration's reader, ``integrations/lightning/recovery_metrics.py``) before each training
batch and logs, per recovery the agent finished, the same fields as the Lightning integration
(docs/lightning.md, "Recovery metrics"), with ``accelerator.log(..., step=<committed steps>)``:
``leto/recovery/{detect,stop,attach_repair,transfer,init,resume,recompute}_s``, ``total_s``,
``first_iteration_s``, ``generation``, ``shadow_level``, ``failed_iteration``,
``resume_iteration``, ``resume_step``, ``kept_iterations`` (steps a restart from the newest
``save_state`` checkpoint would have redone), and the running ``leto/recoveries``,
``leto/hof_count``, ``leto/recovered_iterations``, ``leto/ettr``.

Which recoveries were logged, and the newest checkpoint's step, are part of the resume payload:
a trainer that resumes logs exactly the recoveries its predecessor had not logged by its last
payload. At ``end_training`` the main process waits (up to 5 s) for the books of the last
recovery to close and logs what is left.

One run per job across trainer processes: the processes of a job share ``project_dir``, so
TensorBoard's event files (one per main process: a promoted shadow writes its own) lie in one
run directory; wandb runs (one per main process, as with Lightning) carry one group,
``leto-<run directory name>``, unless ``init_kwargs={"wandb": {"group": ...}}`` names one.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

from ..lightning.recovery_metrics import EventReader, finished_recoveries, metrics_for, recoveries_open

WANDB_FLUSH_ENV = "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"  # wandb's x_transaction_log_flush_interval
WANDB_FLUSH_S = "1.0"  # trainers die by SIGKILL: wandb's default 15 s between writes would lose history


class Logging(Protocol):
    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None: ...


def wandb_group(run_dir: str) -> str:
    """The wandb group of a job's runs (the Lightning integration's rule)."""
    return "leto-" + os.path.basename(os.path.abspath(run_dir))


def tracker_kwargs(init_kwargs: dict | None, run_dir: str) -> dict:
    """``init_trackers``' ``init_kwargs`` with the job's wandb group (module doc)."""
    kwargs = dict(init_kwargs or {})
    kwargs["wandb"] = dict(kwargs.get("wandb") or {})
    kwargs["wandb"].setdefault("group", wandb_group(run_dir))
    os.environ.setdefault(WANDB_FLUSH_ENV, WANDB_FLUSH_S)
    return kwargs


class RecoveryLog:
    """The recovery metrics one main process logged (module doc)."""

    def __init__(self) -> None:
        self.reader: EventReader | None = None  # on the main process under an agent only
        self.logged: set[int] = set()  # generations whose recovery metrics were logged
        self.recovered = 0  # sum of kept_iterations so far
        self.saved_iteration = 0  # the retained iteration of the newest save_state checkpoint

    def start(self, run_dir: str) -> None:
        self.reader = EventReader(run_dir)

    def state(self) -> dict[str, Any]:
        return {"logged": sorted(self.logged), "recovered": self.recovered, "saved": self.saved_iteration}

    def restore(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.logged = set(state.get("logged", ()))
        self.recovered = int(state.get("recovered", 0))
        self.saved_iteration = int(state.get("saved", 0))

    def log_new(self, acc: Logging, step: int) -> int:
        """Log the recoveries the agent finished since the last call; how many."""
        if self.reader is None:
            return 0
        self.reader.poll()
        logged = 0
        for event in finished_recoveries(self.reader.events):
            if event.generation in self.logged:
                continue
            resume = int(event.resume_iteration or 0)
            kept = max(0, resume - self.saved_iteration)
            metrics = metrics_for(event, self.reader.events, kept, self.recovered)
            metrics["leto/recovery/resume_step"] = float(resume)
            acc.log(metrics, step=step)
            self.logged.add(event.generation)
            self.recovered += kept
            logged += 1
        return logged

    def finish(self, acc: Logging, step: int, wait_s: float = 5.0) -> None:
        """At ``end_training``: wait for the last recovery's books to close, log what is left."""
        if self.reader is None:
            return
        deadline = time.time() + wait_s
        while True:
            self.reader.poll()
            if not recoveries_open(self.reader.events) or time.time() > deadline:
                break
            time.sleep(0.05)
        self.log_new(acc, step)
