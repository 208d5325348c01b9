"""The per-node agent of ``leto launch``: starts the trainers, watches them, recovers.

Lifecycle of one failure (docs/design.md section 2.5)::

    detect (exit / hang) -> classify -> HOF: stop every active trainer -> new generation ->
    recover retained state (undo-restore, repair, roll forward) -> promote the shadows (or start
    cold trainers that attach) -> wait until every rank resumed -> start fresh shadows
    non-HOF (or damage beyond parity): stop everything -> checkpoint restart

A failure while recovering simply starts the next generation. Every step is in the event log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..errors import ConfigurationError, LetoError
from ..retained.shm import new_job_id, unlink_segments
from . import auth, control, keys, rundir, worker_env
from .classify import Failure
from .config import RuntimeConfig
from .events import EventLog
from .procs import TrainerProcess, process_state, spawn
from .reclaim import ReclaimConfig, ShadowReclaimer
from .recovery_flow import RecoveryMixin
from .storage import StorageError


@dataclass
class LaunchSpec:
    script: str
    args: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_dir: str = "leto-runs/latest"
    faults: list[dict] = field(default_factory=list)
    python: str = sys.executable
    # Per-rank supervision (torchrun / srun workers that became their rank's agent): this agent is
    # one of ``nnodes`` one-rank "nodes" (``node_rank`` = the rank); its trainers see the real
    # layout (local rank, local world size, node rank) so that Lightning's rank arithmetic holds.
    trainer_layout: tuple[int, int, int] | None = None
    external_store: bool = False  # connect to a store hosted elsewhere (torchrun's agent store)
    store_prefix: str = ""  # namespace of the job's keys in that store
    run_dir_mode: int = rundir.DEFAULT_MODE  # the run dir's permissions; files get them without x bits
    secret_file: str | None = None  # the job's control-plane secret, the same on every node (runtime/auth.py)

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigurationError(f"nproc_per_node={self.nproc_per_node} and nnodes={self.nnodes} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigurationError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.external_store and not self.master_port:
            raise ConfigurationError("an external store needs its --master-port")
        if not 0 <= self.master_port <= 65535:
            raise ConfigurationError(f"--master-port {self.master_port}: a TCP port is 1..65535 (0: pick a free one)")
        if self.trainer_layout is not None:
            self._check_layout(*self.trainer_layout)

    def _check_layout(self, local_rank: int, local_world_size: int, node: int) -> None:
        if self.nproc_per_node != 1:
            raise ValueError(f"--trainer-layout supervises one rank per agent: --nproc-per-node must be 1, "
                             f"not {self.nproc_per_node}")
        if not 0 <= local_rank < local_world_size or node < 0:
            raise ValueError(f"trainer layout (local rank {local_rank}, local world size {local_world_size}, node "
                             f"{node}): need 0 <= local rank < local world size and node >= 0")
        if self.nnodes % local_world_size or node * local_world_size + local_rank != self.node_rank:
            raise ValueError(
                f"rank {self.node_rank} of {self.nnodes} as local rank {local_rank} of {local_world_size} on node "
                f"{node}: ranks must be laid out node by node (rank = node x local world size + local rank), with "
                "the same number on every node")

    def preflight(self) -> None:
        """What can be checked before anything starts: a wrong value fails in a second with its
        name, instead of after a minute's hang or twenty restarts of a trainer that cannot start."""
        if not self.script.startswith("-") and not os.path.isfile(self.script):
            raise ConfigurationError(f"training script {self.script!r} not found: give the path of an existing file")
        try:
            socket.getaddrinfo(self.master_addr, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise ConfigurationError(f"--master-addr {self.master_addr!r} is not an address or host name this machine "
                                     f"can resolve ({exc}): give node 0's address, e.g. 127.0.0.1") from None
        cores, devices = len(os.sched_getaffinity(0)), _device_count()
        limit = max(devices, MAX_RANKS_PER_CORE * cores)
        if self.nproc_per_node > limit:
            raise ConfigurationError(
                f"--nproc-per-node {self.nproc_per_node}: far more ranks than this machine has ({cores} CPU cores, "
                f"{devices} GPUs; at most {limit}), each with a shadow trainer -- use one rank per GPU or core")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def events_dir(self) -> str:
        """Per-rank agents share the run dir; the job's ``events.jsonl`` is rank 0's agent's."""
        if self.trainer_layout is None or self.node_rank == 0:
            return self.run_dir
        return os.path.join(self.run_dir, "agents", f"rank{self.node_rank}")


MAX_RANKS_PER_CORE = 4  # a CPU job beyond this many ranks (each with a shadow) per core is a typo


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class JobStopped(LetoError):
    """The job cannot go on (failure budget, no recovery path); the message says why."""


class JobInterrupted(LetoError):
    """A stop request (SIGINT/SIGTERM to the launcher) won over whatever the agent was doing."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Agent(RecoveryMixin):
    def __init__(self, spec: LaunchSpec, config: RuntimeConfig | None = None, out=None,
                 reclaim: ReclaimConfig | None = None) -> None:
        spec.preflight()
        self.spec = spec
        self.config = config or RuntimeConfig()
        self.out = out or sys.stdout
        self.reclaim = ShadowReclaimer(self, reclaim) if reclaim is not None else None  # memory probe + policy
        # one live job per run dir; 0700 and umask 077 before anything is written there
        self.run_dir_claim = rundir.claim(spec.run_dir, spec.run_dir_mode, spec.events_dir, spec.node_rank)
        self.events = EventLog(spec.events_dir)
        if self.run_dir_claim.previous:
            self.events.emit("run_dir_lock_taken_over", 0, previous=self.run_dir_claim.previous)
        self.generation = 0
        self.shadow_set = ""  # "<generation>-<k>": derived from job-wide events, so equal on all nodes
        self._replacements_seen = 0
        self.job_id = new_job_id()
        self.all_job_ids = [self.job_id]
        self.actives: dict[int, TrainerProcess] = {}
        self.shadows: dict[int, TrainerProcess] = {}
        self.failure_times: deque[float] = deque()
        self.pending_recovery: dict | None = None
        self._shadows_due = False
        self._heartbeats: dict[int, tuple[bytes, float]] = {}
        self._stop_signal: int | None = None
        self._stop = threading.Event()  # a stop request: every wait loop of the agent polls it
        self._startup_failures: set[tuple] = set()  # (exit code, message) of trainers that died before a heartbeat
        self._last_poll = time.time()
        self.store: dist.Store | None = None
        self.thread_defaults = worker_env.omp_defaults(spec.nproc_per_node)  # torchrun's rule, decided once

    # -- the main loop ---------------------------------------------------------------------
    def run(self) -> int:
        import torch

        # The agent's own tensor work (roll-forward, repair) must not fight the trainers for
        # cores: measured 2.8 s vs 0.2 s for one repair on a loaded 2-core machine.
        torch.set_num_threads(1)
        notice = worker_env.omp_notice(self.thread_defaults)
        if notice is not None:  # torchrun's notice, once per launch
            print(notice, file=self.out, flush=True)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_store()
            self.job_id = self._shared_job_id(self.job_id)
            self.all_job_ids = [self.job_id]
            self.events.emit("job_started", 0, port=self.port, world_size=self.spec.world_size, job_id=self.job_id,
                             node_rank=self.spec.node_rank, script=self.spec.script, pid=os.getpid())
            self._start_actives(resume="")
            self._start_shadows()
            return self._loop()
        except JobInterrupted as exc:
            self.events.try_emit("job_interrupted", self.generation, signal=exc.signum)
            print(f"[leto] job {exc}: trainers stopped, retained memory freed", file=self.out, flush=True)
            return 128 + exc.signum
        except (JobStopped, StorageError) as exc:  # a full run dir: no restart can help
            self.events.try_emit("job_stopped", self.generation, reason=str(exc))
            print(f"[leto] job stopped: {exc}", file=self.out, flush=True)
            return 3
        finally:
            self._shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _loop(self) -> int:
        while True:
            self._check_stop()
            self._track_first_iteration()
            finished = self._finished()
            if finished is not None:
                self._wait_other_nodes_done()
                self.events.emit("job_finished", self.generation, exit_code=finished, recoveries=self.generation)
                return finished
            failure = self._detect()
            if failure is not None:
                self._handle(failure)
            else:
                self._watch_shadows()
                self._publish_shadow_readiness()
                if self.reclaim is not None:
                    self.reclaim.poll()
            self._stop.wait(self.config.poll_interval)

    def _wait_other_nodes_done(self) -> None:
        """Node 0 hosts the store: it stays up until every node's trainers finished."""
        if self.spec.nnodes == 1:
            return
        self.store.set(f"done/{self.spec.node_rank}", "1")
        if self.spec.node_rank == 0:
            self._wait_keys([f"done/{n}" for n in range(self.spec.nnodes)], "every node's trainers to finish")

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum
        self._stop.set()

    def _check_stop(self) -> None:
        """A stop request wins over any step of the job (recovery included): called by every wait."""
        if self._stop.is_set():
            raise JobInterrupted(self._stop_signal or signal.SIGTERM)

    def _wait_keys(self, names: list[str], what: str) -> None:
        """Wait (at most the start-up timeout) until the store has ``names``; a stop request ends it."""
        deadline = time.time() + self.config.startup_timeout
        while not self.store.check(names):
            self._check_stop()
            if time.time() > deadline:
                raise JobStopped(f"waited {self.config.startup_timeout:.0f} s for {what} (--startup-timeout); "
                                 "is another node's agent gone?")
            self._stop.wait(self.config.poll_interval)

    # -- processes -------------------------------------------------------------------------
    def _start_store(self) -> None:
        s = self.spec
        if s.nnodes > 1 and not s.master_port:
            raise ValueError("a multi-node job needs --master-port (the same on every node)")
        try:
            if s.node_rank == 0 and not s.external_store:  # listens on --master-addr only (loopback by default)
                store, _ = control.host_store(s.master_addr, s.master_port, timedelta(seconds=60))
            else:
                store = dist.TCPStore(s.master_addr, s.master_port, world_size=None, is_master=False,
                                      timeout=timedelta(seconds=60), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
            raise ConfigurationError(_store_problem(s, exc)) from exc
        self.port = store.port
        raw = dist.PrefixStore(s.store_prefix, store) if s.store_prefix else store
        self.secret = auth.job_secret(raw, s.node_rank, s.nnodes, s.run_dir, s.secret_file,
                                      self.config.startup_timeout, self._check_stop)
        self.store = control.SignedStore(raw, self.secret, s.store_prefix, self._message_rejected)

    def _message_rejected(self, key: str, reason: str) -> None:
        """A control message without the job's secret (or a replay): ignored, and on record."""
        self.events.emit("control_message_rejected", self.generation, key=key, reason=reason, reader="agent",
                         pid=os.getpid())

    def _shared_job_id(self, mine: str) -> str:
        """Per-rank agents agree on one retained-memory job id per start (first writer wins):
        the trainers of a node's ranks attach each other's stores for tier-2 parity."""
        if self.spec.trainer_layout is None:
            return mine
        got = self.store.compare_set(keys.JOB_ID.format(gen=self.generation), "", mine)
        return got.decode() if isinstance(got, bytes) else str(got)

    def _device_index(self, rank: int) -> int:
        """The local index (device) of a rank of this agent."""
        if self.spec.trainer_layout is not None:
            return self.spec.trainer_layout[0]
        return rank - self.spec.node_rank * self.spec.nproc_per_node

    def _env(self, local_rank: int, role: str, generation: int, resume: str) -> dict[str, str]:
        s = self.spec
        rank = s.node_rank * s.nproc_per_node + local_rank
        env = dict(os.environ)
        env.update(self.thread_defaults)
        # per-rank supervision: the real layout (Lightning computes ranks from it)
        local, size, node = s.trainer_layout or (local_rank, s.nproc_per_node, s.node_rank)
        env.update(worker_env.torchrun_variables(rank, local, s.world_size, size, node, s.master_addr, self.port))
        env.update(
            LETO_NODE_RANK=str(node), LETO_ROLE=role, LETO_JOB_ID=self.job_id,
            LETO_RUN_DIR=os.path.abspath(s.run_dir), LETO_GENERATION=str(generation),
            LETO_SHADOW_SET=str(self.shadow_set), LETO_SHADOW_LEVEL=str(self._shadow_level()), LETO_RESUME=resume,
            LETO_FAULTS=json.dumps(self._pending_faults()),
        )
        env[auth.CHILD_ENV] = self.secret.hex()  # the trainers' copy of the job's secret: their environment only
        env["LETO_EVENTS"] = str(self.events.path.absolute())
        env.pop("LETO_STORE_PREFIX", None)
        if s.store_prefix:
            env["LETO_STORE_PREFIX"] = s.store_prefix
        return env

    def _spawn(self, local_rank: int, role: str, resume: str) -> TrainerProcess:
        self._check_stop()  # nothing new starts once a stop was requested
        env = self._env(local_rank, role, self.generation, resume)
        proc = spawn([self.spec.python, self.spec.script, *self.spec.args], env, int(env["RANK"]), local_rank, role,
                     self.generation, self.shadow_set, self.out)
        self.events.emit("process_started", self.generation, rank=proc.rank, role=role, pid=proc.pid,
                         shadow_set=self.shadow_set if role == "shadow" else None, resume=resume or None)
        return proc

    def _start_actives(self, resume: str) -> None:
        for rank in self._local_ranks():
            self.store.set(keys.HEARTBEAT.format(rank=rank), "")
        self._heartbeats.clear()
        self.actives = {p.rank: p for p in (self._spawn(lr, "active", resume) for lr in range(self.spec.nproc_per_node))}

    def _start_shadows(self, replacement: int = 0) -> None:
        self.store.set(keys.SHADOWS_READY, "")
        if not self.config.shadows or not self._shadow_level():  # level 0: memory reclaim runs without one
            return
        self.shadow_set = f"{self.generation}-{replacement}"
        self._replacements_seen = replacement
        self.shadows = {p.rank: p for p in (self._spawn(lr, "shadow", "") for lr in range(self.spec.nproc_per_node))}
        self.events.emit("shadow_level", self.generation, shadow_set=self.shadow_set, level=self._shadow_level(),
                         reason="started")

    def _publish_shadow_readiness(self) -> None:
        ranks = range(self.spec.world_size)  # a shadow set is one process group across all nodes
        if self.shadows and not self.store.get(keys.SHADOWS_READY) and all(
                self.store.check([keys.SHADOW_READY.format(sgen=self.shadow_set, rank=r)]) for r in ranks):
            self.store.set(keys.SHADOWS_READY, str(self.shadow_set))
            self.events.emit("shadow_level", self.generation, shadow_set=self.shadow_set,
                             level=self._shadow_level(), reason="ready")

    def _shadow_level(self) -> int:
        """The level new shadows start at: the memory policy's when it runs (runtime/reclaim.py)."""
        return int(self.reclaim.level) if self.reclaim is not None else self.config.shadow_level

    def _local_ranks(self) -> list[int]:
        first = self.spec.node_rank * self.spec.nproc_per_node
        return list(range(first, first + self.spec.nproc_per_node))

    def _pending_faults(self) -> list[dict]:
        if self.store is None:
            return list(self.spec.faults)
        return [f for f in self.spec.faults if not self.store.check([keys.FAULT_FIRED.format(id=f["id"])])]

    def _kill(self, procs: dict[int, TrainerProcess]) -> None:
        for p in procs.values():
            try:
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs.values():
            p.kill()

    def _shutdown(self) -> None:
        self._kill(self.actives)
        self._kill(self.shadows)
        self.actives, self.shadows = {}, {}
        for job in self.all_job_ids:
            unlink_segments(job)
        if self.reclaim is not None:
            self.reclaim.close()
        self.events.close()
        self.run_dir_claim.release()

    # -- detection -------------------------------------------------------------------------
    def _finished(self) -> int | None:
        codes = [p.poll() for p in self.actives.values()]
        if codes and all(c == 0 or (c is not None and self._completed(p)) for c, p in zip(codes, self.actives.values())):
            return 0
        return None

    def _completed(self, p: TrainerProcess) -> bool:
        """The trainer said it finished training (whatever its exit status after that)."""
        return self.store.check([keys.FINISHED.format(gen=p.generation, rank=p.rank)])

    def _detect(self) -> Failure | None:
        """One poll of every active trainer. ``_last_poll`` is the last poll that saw nothing
        wrong: a failure happened after it (the recovery breakdown's ``detect`` starts there)."""
        self._check_stop()
        now = time.time()
        failure = self._find_failure(now)
        if failure is None:
            self._last_poll = now
        elif _stop_signal_death(failure):
            self._await_stop_request(failure)
        return failure

    def _find_failure(self, now: float) -> Failure | None:
        remote = self._remote_failure()
        if remote is not None:
            return remote
        for p in self.actives.values():
            code = p.poll()
            if code is not None and code != 0 and not self._completed(p):
                exit_code, sig = p.exit_status()
                return self._failure(p, exit_code=exit_code, signal=sig)
        hung = [p for p in self.actives.values() if p.poll() is None and self._hung(p, now)]
        if hung:  # survivors block in collectives soon after the culprit stops: blame a stopped
            # process (state T) first, then the one whose own last heartbeat is oldest
            return self._failure(min(hung, key=lambda p: (not _stopped(p.pid), self._beat_time(p.rank))), hang=True)
        return None

    def _await_stop_request(self, failure: Failure) -> None:
        """A trainer died of SIGTERM/SIGINT: a scheduler (``timeout``, SLURM) signals the whole
        process group, and the launcher's own signal may land a moment later. A stop request
        within the grace period makes it a shutdown, not a failure to recover."""
        self._stop.wait(STOP_GRACE_S)
        self._check_stop()

    def _beat_time(self, rank: int) -> float:
        return self._last_heartbeat(rank).get("t", self._heartbeats[rank][1])

    def _failure(self, p: TrainerProcess, **how) -> Failure:
        hb = self._last_heartbeat(p.rank)
        exc = None
        key = keys.EXCEPTION.format(pid=p.pid)
        if self.store.check([key]):
            exc = self.store.get(key).decode(errors="replace")
        f = Failure(rank=p.rank, pid=p.pid, role=p.role, exception=exc, detected_at=time.time(),
                    iteration=hb.get("it"), phase=hb.get("phase"), last_heartbeat=hb.get("t"), **how)
        return f

    def _remote_failure(self) -> Failure | None:
        """Another node's agent declared a failure of this generation: recover in lockstep."""
        if self.spec.nnodes == 1:
            return None
        key = keys.FAILURE.format(gen=self.generation)
        if not self.store.check([key]):
            return None
        verdict = json.loads(self.store.get(key))
        if verdict["node"] == self.spec.node_rank:
            return None
        return Failure(rank=verdict["rank"], pid=None, role="remote", detected_at=time.time(),
                       exception=f"on node {verdict['node']}: {verdict['reason']}", remote_verdict=verdict)

    def _last_heartbeat(self, rank: int) -> dict:
        raw = self.store.get(keys.HEARTBEAT.format(rank=rank))
        return json.loads(raw) if raw else {}

    def _hung(self, p: TrainerProcess, now: float) -> bool:
        raw = self.store.get(keys.HEARTBEAT.format(rank=p.rank))
        seen = self._heartbeats.get(p.rank)
        if seen is None or seen[0] != raw:
            self._heartbeats[p.rank] = (raw, now)
            return False
        limit = self.config.heartbeat_timeout if raw else self.config.startup_timeout
        return now - seen[1] > limit


def _store_problem(s: LaunchSpec, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"{s.master_addr}:{s.master_port}"
    if "address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc):
        return f"--master-port {s.master_port} is already in use: choose a free port, or 0 for any ({first})"
    if s.node_rank == 0 and not s.external_store:
        return f"cannot host the job's store on {where} ({first}): check --master-addr and --master-port"
    return f"cannot reach the job's store at {where} ({first}): start node 0 first, check --master-addr/--master-port"


STOP_GRACE_S = 1.0  # how long a trainer's SIGTERM/SIGINT death waits for the launcher's own signal


def _stop_signal_death(failure: Failure) -> bool:
    """The trainer ended by SIGTERM/SIGINT (killed by it, its shell-style exit code, or Python's
    KeyboardInterrupt) -- what a stop request to the whole process group does to it."""
    stop = (signal.SIGTERM, signal.SIGINT)
    return (failure.signal in stop or failure.exit_code in tuple(128 + s for s in stop)
            or "KeyboardInterrupt" in (failure.exception or ""))


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a debugger) rather than waiting in a collective."""
    return process_state(pid) in ("T", "t")
