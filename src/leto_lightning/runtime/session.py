"""The trainer's side of the runtime: what a training script calls.

    import leto_lightning.runtime as leto
    session = leto.init()                     # a shadow at L1/L2 waits here until promoted
    session.init_process_group("gloo")        # L3 shadows build it ahead (among shadows)
    model, opt = build()
    train = session.protect(model, opt)       # L3 shadows bind retained views, then wait here
    for it in range(train.start_iteration, total):
        train.begin(it)
        loss_fn(model(batch(it))).backward()
        train.all_reduce_grads()
        train.step(payload={"next": it + 1})  # chunk transactions, agreed across ranks
    train.finish()

The same script runs as the active trainer and as its shadow (``LETO_ROLE``); the difference
is only *where* each call returns.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from ..env import EVENTS, JOB_ID, ROLE, STORE_PREFIX, ResumeMode, Role, WorkerContract
from ..errors import ConfigurationError, LetoTimeoutError, UnsafeCheckpoint, UsageError
from ..faults.injector import FaultInjector
from ..faults.points import point
from .auth import CHILD_ENV
from .checkpoints import CheckpointCommits
from .control import SignedStore
from .event_types import ControlMessageRejected
from .events import event_line
from .keys import (
    EXCEPTION,
    FAULT_FIRED,
    FINISHED,
    FIRST_DONE,
    HEARTBEAT,
    PG_PREFIX,
    PROMOTE,
    RESUMED,
    SHADOW_READY,
    SHADOWS_READY,
    STORE_READY,
)
from .messages import FirstDone, Heartbeat, Promotion, ResumeInfo, TrainerPhase
from .storage import atomic_torch_save, open_run_dir_file, run_dir_path


@dataclass
class SessionEnv:
    """What the launcher put in the environment: torchrun's variables and Leto's contract
    (``leto_lightning/env.py``). ``generation`` moves on when a shadow is promoted."""

    role: Role
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    master_addr: str
    master_port: int
    job_id: str
    run_dir: str
    generation: int
    shadow_set: str  # "<generation>-<replacement>": the same on every node
    level: int
    resume: ResumeMode
    faults: list = field(default_factory=list)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> SessionEnv:
        missing = [k for k in (ROLE, "RANK", "WORLD_SIZE", "MASTER_PORT", JOB_ID) if k not in env]
        if missing:
            raise UsageError(f"not started by `leto launch` (missing {', '.join(missing)}); run the script with "
                             "`leto launch --nproc-per-node N script.py`")
        c = WorkerContract.from_env(env)
        return cls(
            role=c.role, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            node=int(env["GROUP_RANK"]) if "GROUP_RANK" in env else c.node_rank,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env["MASTER_PORT"]),
            job_id=c.job_id, run_dir=c.run_dir, generation=c.generation, shadow_set=c.shadow_set,
            level=c.shadow_level, resume=c.resume, faults=[dict(f) for f in c.faults],
        )


class Session:
    def __init__(self, env: SessionEnv, store: SignedStore) -> None:
        self.env = env
        self.store = store
        self.rank = env.rank
        self.world_size = env.world_size
        self.promoted_at: float | None = None
        self.pg_name = f"s{env.shadow_set}" if env.role == Role.SHADOW else f"g{env.generation}"
        self._iteration = -1
        self._install_exception_reporter()
        FaultInjector(env.faults, _SessionFaults(self)).install()

    @property
    def is_shadow(self) -> bool:
        return self.env.role == Role.SHADOW and self.promoted_at is None

    # -- shadow waiting ---------------------------------------------------------------
    def signal_ready(self) -> None:
        self.store.set(SHADOW_READY.format(sgen=self.env.shadow_set, rank=self.rank), str(time.time()))

    def wait_for_promotion(self) -> None:
        """Block until the agent promotes this shadow set (or dies: then exit)."""
        if not self.is_shadow:
            return
        self.signal_ready()
        key = PROMOTE.format(sgen=self.env.shadow_set)
        await_key(self.store, key)  # any store error: the agent is gone, nothing to shadow
        self.env.generation = Promotion.from_json(self.store.get(key)).generation
        self.promoted_at = time.time()

    # -- distributed --------------------------------------------------------------------
    def init_process_group(self, backend: str = "gloo", timeout: float = 60.0) -> None:
        if self.env.level < 3:
            self.wait_for_promotion()
        prefix = PG_PREFIX.format(name=self.pg_name)
        # NCCL: the communicator is built now (eager init, bound to this rank's GPU), not at the
        # first collective -- a shadow set's is then ready before promotion, which costs no NCCL
        # init; a collective that fails later aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING,
        # set as torchrun sets it), which the agent detects. gloo stays the CPU path.
        device = self.device() if "nccl" in backend else None
        # torch's rendezvous needs a real Store: the unsigned one (as under torchrun; docs/security.md)
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, self.store.raw), rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout), device_id=device)

    def device(self) -> torch.device:
        """This rank's GPU as torchrun's convention assigns it (``cuda:LOCAL_RANK``), made current.
        ``ConfigurationError`` when this process sees no GPU, or fewer than its local rank needs."""
        from ..retained.backends.cuda_device import require_cuda

        require_cuda()
        count, local = torch.cuda.device_count(), self.env.local_rank
        if local >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            raise ConfigurationError(
                f"local rank {local} needs GPU {local}, but this process sees {count} (CUDA_VISIBLE_DEVICES="
                f"{visible}): start at most {count} rank(s) per node (--nproc-per-node), or share GPUs over gloo")
        torch.cuda.set_device(local)
        return torch.device("cuda", local)

    @property
    def creates_store(self) -> bool:
        """An active trainer of a new job (or of a restart from a checkpoint) creates the
        retained store; shadows and cold restarts (``LETO_RESUME=retained``) attach to it."""
        return self.env.role == Role.ACTIVE and self.env.resume != ResumeMode.RETAINED

    def wait_for_store(self) -> None:
        """A shadow starts beside a fresh active trainer: attach once the active created it."""
        await_key(self.store, STORE_READY.format(job=self.env.job_id, rank=self.rank))

    # -- the trainer's side of the protocol: one writer per message ------------------------------
    def report_resumed(self, iteration: int, resume_started: float, set_up_started: float) -> None:
        """This rank resumed at ``iteration`` (loop, RNG, data position restored): the agent's
        ``init`` is from when this process began setting up -- or was promoted, if later -- to
        ``resume_started``; ``resume`` from then to now."""
        now = time.time()
        promoted = self.promoted_at
        begun = promoted if promoted is not None and promoted >= set_up_started else set_up_started
        info = ResumeInfo(init_s=max(0.0, resume_started - begun), resume_s=now - resume_started, iteration=iteration,
                          t=now)
        self.store.set(RESUMED.format(gen=self.env.generation, rank=self.rank), info.to_json())

    def report_first_done(self, iteration: int) -> None:
        """This generation's first iteration on this rank is complete: the agent closes a
        recovery's books on it."""
        done = FirstDone(t=time.time(), it=iteration)
        self.store.set(FIRST_DONE.format(gen=self.env.generation, rank=self.rank), done.to_json())

    def report_exception(self, exc_type: type[BaseException], exc: BaseException) -> None:
        """The exception this process dies of, for the agent's verdict (``<type>: <message>``)."""
        self.store.set(EXCEPTION.format(pid=os.getpid()), f"{exc_type.__name__}: {exc}")

    def barrier(self) -> None:
        """The prepare agreement: one flag all-reduce (raises if a peer is gone)."""
        if dist.is_initialized():
            nccl = dist.get_backend() == "nccl"
            flag = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
            dist.all_reduce(flag)
            if nccl:  # NCCL only enqueues it: the agreement holds once this process has seen it done
                flag.item()

    def mark_finished(self) -> None:
        """Training is complete: a crash while the interpreter shuts down (seen: gloo's threads
        calling std::terminate) must not be taken for a failure and recovered."""
        self.store.set(FINISHED.format(gen=self.env.generation, rank=self.rank), str(time.time()))

    # -- progress ------------------------------------------------------------------------
    def heartbeat(self, iteration: int, phase: TrainerPhase) -> None:
        self._iteration = iteration
        beat = Heartbeat(t=time.time(), it=iteration, phase=phase, pid=os.getpid(), gen=self.env.generation)
        self.store.set(HEARTBEAT.format(rank=self.rank), beat.to_json())

    def _install_exception_reporter(self) -> None:
        previous = sys.excepthook

        def report(exc_type, exc, tb):
            try:
                self.report_exception(exc_type, exc)
            finally:
                previous(exc_type, exc, tb)

        sys.excepthook = report


    @property
    def resume_from_checkpoint(self) -> bool:
        return self.env.resume == ResumeMode.CHECKPOINT

    @property
    def checkpoints(self) -> CheckpointCommits:
        """This job's checkpoint iterations, committed job-wide (``runtime/checkpoints.py``)."""
        return CheckpointCommits(os.path.join(self.env.run_dir, "checkpoints"), self.rank, self.world_size,
                                 self.store, self.env.generation)

    def checkpoint_path(self, iteration: int) -> str:
        """This rank's file of ``iteration``; no link on the way is followed (``PlantedLinkError``)."""
        name = os.path.basename(self.checkpoints.directory(iteration))
        return run_dir_path(self.env.run_dir, "checkpoints", name, f"rank{self.rank}.pt")

    def save_checkpoint(self, state: dict, iteration: int | None = None) -> str:
        """Write this rank's checkpoint of ``iteration`` (default: ``state["iteration"]``, where the
        restart continues) atomically, and commit it once every rank has written its own: a
        restart uses only iterations every rank finished. Every rank calls it for the same
        iterations (it waits for the others). A full disk raises ``StorageError``."""
        if iteration is None:
            if not isinstance(state.get("iteration"), int):
                raise UsageError("save_checkpoint(state, iteration=N): the iteration the restart continues at "
                                 "(or put it in state['iteration'])")
            iteration = state["iteration"]
        path = self.checkpoint_path(iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        point("checkpoint.saving", iteration=iteration)
        atomic_torch_save(state, path)  # no partial file, ever
        point("checkpoint.written", iteration=iteration)
        self.checkpoints.saved(iteration, [path])
        return path

    def load_checkpoint(self) -> dict | None:
        """This rank's file of the newest checkpoint iteration committed job-wide (every rank
        gets the same iteration; None when there is none). Every rank calls it."""
        iteration = self.checkpoints.newest_committed()
        return None if iteration is None else load_checkpoint_file(self.checkpoint_path(iteration))


class _SessionFaults:
    """The session as the fault injector's ``FaultTarget`` (``faults/injector.py``): faults
    strike active trainers only; whether one fired is kept in the job's store."""

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def rank(self) -> int:
        return self._session.rank

    def striking(self) -> bool:
        return not self._session.is_shadow

    def position(self) -> tuple[int, int]:
        return self._session._iteration, self._session.env.generation

    def fired(self, fault_id: object) -> bool:
        return self._session.store.check([FAULT_FIRED.format(id=fault_id)])

    def mark_fired(self, fault_id: object) -> None:
        self._session.store.set(FAULT_FIRED.format(id=fault_id), str(time.time()))

    def ready_shadow_set(self) -> str:
        return self._session.store.get(SHADOWS_READY).decode()


def load_checkpoint_file(path: str) -> dict:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers only -- a pickle
    planted in the run dir is refused instead of run (what ``save_checkpoint`` writes loads)."""
    import pickle

    try:
        with os.fdopen(open_run_dir_file(path, os.O_RDONLY), "rb") as f:  # a link in its place: refused
            return torch.load(f, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]  # torch's middle line names what it refused
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), type(exc).__name__)
        raise UnsafeCheckpoint(f"checkpoint {path!r} holds more than tensors and plain values ({why.strip()}): "
                               "refused, nothing in it was run -- delete it if you did not write it") from None


def _rejection_reporter(env: SessionEnv, events_path: str | None):
    """Trainers record rejected control messages in the agent's event log (one O_APPEND write per
    line: lines never interleave with the agent's)."""

    def report(key: str, reason: str) -> None:
        if not events_path:
            return
        line = event_line(ControlMessageRejected(generation=env.generation, key=key, reason=reason,
                                                 reader=f"rank {env.rank} {env.role}", pid=os.getpid()))
        try:
            fd = os.open(events_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError:  # the run dir is gone or full: the warning in the output stays
            pass

    return report


def connect(env: SessionEnv, environ: Mapping[str, str] = os.environ) -> SignedStore:
    """The agent's store, signed with the job's secret (``LETO_AUTH_KEY``, set by the agent)."""
    if CHILD_ENV not in environ:
        raise UsageError(f"not started by `leto launch` (missing {CHILD_ENV}); run the script with "
                         "`leto launch --nproc-per-node N script.py`")
    store: dist.Store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                      timeout=timedelta(seconds=60))
    prefix = environ.get(STORE_PREFIX, "")
    if prefix:  # the agent's keys live in a namespace of a shared store (torchrun's)
        store = dist.PrefixStore(prefix, store)
    return SignedStore(store, bytes.fromhex(environ[CHILD_ENV]), prefix,
                       _rejection_reporter(env, environ.get(EVENTS)))


WAIT_POLL_S = 0.02  # a waiting shadow looks for its key this often: promotion is noticed within 20 ms


def await_key(store: SignedStore, key: str, timeout_s: float | None = None) -> None:
    """Block until ``key`` has an authentic value: by polling ``check``, never by a store wait
    that times out -- c10d's TCPStore logs a warning for every wait that times out, so a shadow
    waiting in 5 s waits printed two lines every 5 s for as long as it waited. ``timeout_s``:
    ``LetoTimeoutError`` after that long (None: wait as long as it takes)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not store.check([key]):
        if deadline is not None and time.monotonic() > deadline:
            raise LetoTimeoutError(f"wait timeout: no value for {key!r} within {timeout_s:.0f} s")
        time.sleep(WAIT_POLL_S)


AnySession = TypeVar("AnySession", bound=Session)


def init(session_type: type[AnySession] = Session) -> AnySession:  # type: ignore[assignment]  # the default is the bound
    """Connect to the agent of ``leto launch``. Shadows at level 1 or 2 wait here.
    (``leto_lightning.runtime.init()`` is ``protected.init``: a session that can ``protect``.)"""
    env = SessionEnv.from_environ()
    session = session_type(env, connect(env))
    if session.is_shadow and env.level < 3:
        if env.level == 2 and torch.cuda.is_available():
            session.device()
            torch.cuda.init()  # L2: the device runtime (a CUDA context on this rank's GPU), nothing else
        session.wait_for_promotion()
    return session
