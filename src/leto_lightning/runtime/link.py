"""A protected trainer under ``leto launch``: the trainer's side of the runtime contract.

Used by ``LetoStrategy`` (Lightning) and ``LetoAccelerator`` (Accelerate) alike: nothing here
knows the trainer library. The contract (docs/runtime.md; ``examples/plain_ddp.py`` follows it
by hand) and where ``LetoStrategy`` meets each part:

1. ``runtime.init()`` connects to the agent's TCPStore -- ``setup_environment``. Shadows at
   level 1 or 2 block there until promoted.
2. The process group comes from ``Session.init_process_group`` (a prefix store per generation
   or shadow set) -- ``setup_distributed``; Lightning's ``_init_dist_connection`` never runs
   (it would create a second TCPStore on the agent's port).
3. The active trainers of generation 0 create the retained stores, encode tier 2 and set
   ``STORE_READY``; shadows and cold restarts (``LETO_RESUME=retained``) attach, bind the
   views (``bind(adopt=True, resume=False)``), wait for promotion fully built (level 3), then
   ``resume()`` -- ``configure_ddp``. ``RESUMED`` is set once Lightning has restored the loop,
   RNG and data position (``on_train_start``).
4. Heartbeats ``compute`` / ``update`` / ``done`` per optimizer step, ``point("compute.begin")``
   at every training batch, ``FIRST_DONE`` after the first step of a generation; a heartbeat
   during validation at most every ``heartbeat_interval``.
5. The prepare barrier is the session's flag all-reduce.

One ``Session`` per process (module global): a second ``fit()`` reuses it.
"""

from __future__ import annotations

import os
import time

from ..env import RESUME, ROLE, ResumeMode, Role
from ..faults.points import point
from .keys import STORE_READY
from .messages import TrainerPhase
from .session import Session, SessionEnv, await_key, init

_SESSION: Session | None = None
_IMPORTED_AT = time.time()


def session() -> Session:
    """This process's session with the agent (connects on first use; L1/L2 shadows wait here)."""
    global _SESSION
    if _SESSION is None:
        _SESSION = init()
    return _SESSION


def process_start_time() -> float:
    """When this process started (Linux /proc; elsewhere: when this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:  # not /proc/stat's btime: whole seconds only
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return _IMPORTED_AT


class RuntimeLink:
    """What a protected trainer says to, and asks of, the agent (module doc)."""

    def __init__(self, heartbeat_interval: float = 1.0, session: Session | None = None) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.session: Session | None = session  # None: this process's (connects on first use)
        self._first_done = False
        self._resume_started: float | None = None
        self._resume_iteration: int | None = None
        self._set_up_started: float | None = None  # when this process began binding (its protect())
        self._last_beat = 0.0

    # -- who this process is ---------------------------------------------------------------
    def connect(self) -> Session:
        if self.session is None:
            self.session = session()
        return self.session

    @property
    def env(self) -> SessionEnv:
        return self.connect().env

    @property
    def resumes(self) -> bool:
        """This process continues from retained memory: a shadow, or a cold restart (read from
        the environment: deciding this needs no connection to the agent)."""
        return os.environ.get(ROLE) == Role.SHADOW or os.environ.get(RESUME, "") == ResumeMode.RETAINED

    @property
    def run_dir(self) -> str:
        return self.env.run_dir

    # -- process group and store ----------------------------------------------------------------
    def init_process_group(self, backend: str, timeout_s: float) -> None:
        """Under the session's prefix: ``g<generation>`` for actives, ``s<shadow set>`` for shadows."""
        self.connect().init_process_group(backend, timeout=timeout_s)

    def barrier(self) -> None:
        self.connect().barrier()

    def store_ready(self) -> None:
        """A new store is created and encoded (tier 2 included): shadows may attach."""
        env = self.env
        self.connect().store.set(STORE_READY.format(job=env.job_id, rank=env.rank), "1")

    def wait_for_store(self) -> None:
        self.connect().wait_for_store()

    def wait_for_promotion(self) -> None:
        """A level-3 shadow waits here fully built; afterwards the resume clock runs."""
        s = self.connect()
        s.wait_for_promotion()
        point("promotion.resume")
        self._resume_started = time.time()

    def binding_started(self) -> None:
        """This process begins binding to retained state (plain PyTorch's ``protect()``): the
        agent's ``start`` ends here and the resumed message's ``init`` begins (docs/events.md)."""
        if self._set_up_started is None:
            self._set_up_started = time.time()

    def resumed(self, iteration: int) -> None:
        """Tell the agent this rank resumed (loop, RNG and data position restored)."""
        started = self._resume_started if self._resume_started is not None else time.time()
        set_up = self._set_up_started if self._set_up_started is not None else process_start_time()
        self.connect().report_resumed(iteration, resume_started=started, set_up_started=set_up)
        self._resume_started = None

    @property
    def resume_pending(self) -> bool:
        return self._resume_started is not None

    # -- progress --------------------------------------------------------------------------------
    def batch_start(self, iteration: int) -> None:
        self.connect().heartbeat(iteration, TrainerPhase.COMPUTE)
        self._last_beat = time.time()
        point("compute.begin", iteration=iteration)

    def update_start(self, iteration: int) -> None:
        self.connect().heartbeat(iteration, TrainerPhase.UPDATE)

    def step_done(self, iteration: int) -> None:
        s = self.connect()
        s.heartbeat(iteration, TrainerPhase.DONE)
        self._last_beat = time.time()
        if not self._first_done:  # the agent closes a recovery's books on this
            self._first_done = True
            s.report_first_done(iteration)

    def alive(self, iteration: int, phase: TrainerPhase) -> None:
        """Between steps (validation, checkpoints): a heartbeat at most every interval."""
        now = time.time()
        if now - self._last_beat >= self.heartbeat_interval:
            self.connect().heartbeat(iteration, phase)
            self._last_beat = now

    def finished(self) -> None:
        """Training is complete (a crash during interpreter exit is then no failure)."""
        if self.session is not None:
            self.session.mark_finished()

    def report_exception(self, exception: BaseException) -> None:
        s = self.connect()
        try:
            s.report_exception(type(exception), exception)
        except Exception:  # pragma: no cover - the agent is gone; nothing to tell
            pass

    # -- small key-value agreement between the job's processes -------------------------------
    def publish_once(self, key: str, value: str) -> str:
        """The first value ever published under ``key`` in this job (first writer wins)."""
        got = self.connect().store.compare_set(key, "", value)
        return got.decode() if isinstance(got, bytes) else str(got)

    def set_value(self, key: str, value: str) -> None:
        self.connect().store.set(key, value)

    def get_value(self, key: str) -> str | None:
        """The value under ``key``, None if nothing was set (no waiting)."""
        store = self.connect().store
        return store.get(key).decode() if store.check([key]) else None

    def wait_value(self, key: str, timeout_s: float = 600.0) -> str:
        store = self.connect().store
        await_key(store, key, timeout_s)  # polled: a store wait that times out logs a c10d warning
        return store.get(key).decode()
