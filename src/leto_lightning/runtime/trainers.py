"""The trainer processes of one agent: the active trainers and their shadows, by rank.

``Trainers`` starts them (environment, output prefix, event), stops them (SIGKILL by pid),
promotes a ready shadow set, replaces a shadow set one of whose members died (on every node:
the set is one process group), and publishes when the whole shadow set is ready. It owns the
``actives`` / ``shadows`` maps, the shadow set's name and the heartbeats seen per rank.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from typing import TextIO

from ..env import ResumeMode, Role, WorkerContract, worker_environment
from .config import RuntimeConfig
from .control import SignedStore
from .coordination import JobIdentity, StopFlag
from .event_types import (
    ControlKeyMissing,
    ProcessStarted,
    ShadowFailed,
    ShadowLevelReached,
    WarmTemplateReport,
)
from .events import EventLog
from .keys import FAULT_FIRED, HEARTBEAT, PROMOTE, SHADOW_READY, SHADOW_REPLACE, SHADOWS_READY
from .messages import Promotion
from .procs import TrainerProcess, spawn
from .procs_state import process_state
from .spec import LaunchSpec
from .warm_template import ForkedProcess, WarmTemplate
from .worker_env import torchrun_variables


class Trainers:
    def __init__(self, spec: LaunchSpec, config: RuntimeConfig, job: JobIdentity, store: SignedStore,
                 events: EventLog, out: TextIO, stop: StopFlag, secret: bytes, port: int,
                 thread_defaults: Mapping[str, str], level: Callable[[], int]) -> None:
        self.spec, self.config, self.job, self.store = spec, config, job, store
        self.events, self.out, self.stop = events, out, stop
        self._secret, self._port, self._thread_defaults = secret, port, dict(thread_defaults)
        self._level = level  # the level new shadows start at: the memory policy's when it runs
        self.actives: dict[int, TrainerProcess] = {}
        self.shadows: dict[int, TrainerProcess] = {}
        self.shadow_set = ""  # "<generation>-<k>": derived from job-wide events, so equal on all nodes
        self.replacements_seen = 0
        self.heartbeats: dict[int, tuple[bytes, float]] = {}  # rank -> (last heartbeat seen, when it changed)
        self.cuda_manager: Callable[[int], str] = lambda local_rank: ""  # the agent's state managers
        self._missing_reported: set[tuple[str, int]] = set()
        self.template: WarmTemplate | None = None  # the node's warm template (runtime/template_server.py)
        self._template_reported = False

    @property
    def shadow_level(self) -> int:
        return self._level()

    # -- starting ------------------------------------------------------------------------------
    def environment(self, local_rank: int, role: Role, resume: ResumeMode) -> dict[str, str]:
        """torchrun's variables (``worker_env.py``) and Leto's contract (``env.py``) over
        this agent's own environment."""
        s = self.spec
        rank = s.node_rank * s.nproc_per_node + local_rank
        base = dict(os.environ)
        base.update(self._thread_defaults)
        # per-rank supervision: the real layout (Lightning computes ranks from it)
        local, size, node = s.trainer_layout or (local_rank, s.nproc_per_node, s.node_rank)
        base.update(torchrun_variables(rank, local, s.world_size, size, node, s.master_addr, self._port))
        worker = WorkerContract(
            role=role, job_id=self.job.job_id, run_dir=os.path.abspath(s.run_dir), node_rank=node,
            generation=self.job.generation, shadow_set=self.shadow_set, shadow_level=self.shadow_level,
            resume=resume, faults=tuple(self.pending_faults()), events=str(self.events.path.absolute()),
            store_prefix=s.store_prefix, cuda_manager=self.cuda_manager(local_rank),
            auth_key=self._secret.hex())  # the trainers' copy of the job's secret: their environment only
        return worker_environment(base, worker)

    def pending_faults(self) -> list[dict]:
        return [f for f in self.spec.faults if not self.store.check([FAULT_FIRED.format(id=f["id"])])]

    def start_template(self) -> None:
        """The node's warm template, importing what the script imports while the first trainers
        start; later trainers are forked from it once it is ready (``--no-warm-template``: never)."""
        if self.config.warm_template and self.template is None and self.spec.script.endswith(".py"):
            env = self.environment(0, Role.SHADOW, ResumeMode.FRESH)
            self.template = WarmTemplate.start(self.spec.python, self.spec.script, env)

    def _ready_template(self) -> WarmTemplate | None:
        """The template if it can fork now; its report goes on record once (``warm_template``)."""
        status = self.template.check() if self.template is not None else None
        if status is not None and not self._template_reported:
            self._template_reported = True
            self.events.write(WarmTemplateReport(generation=self.job.generation, ready=status.ready,
                                                 reason=status.reason, import_s=status.import_s,
                                                 modules=status.modules))
            if not status.ready:
                self.out.write(f"[leto] warm template unavailable ({status.reason}): trainers start from a new "
                               "interpreter\n")
        return self.template if status is not None and status.ready else None

    def close_template(self) -> None:
        if self.template is not None:
            self.template.close()
            self.template = None

    def _spawn(self, local_rank: int, role: Role, resume: ResumeMode) -> TrainerProcess:
        self.stop.check()  # nothing new starts once a stop was requested
        env = self.environment(local_rank, role, resume)
        gen = self.job.generation
        template = self._ready_template()
        proc = spawn([self.spec.python, self.spec.script, *self.spec.args], env, int(env["RANK"]), local_rank, role,
                     gen, self.shadow_set, self.out, template)
        self.events.write(ProcessStarted(
            generation=gen, rank=proc.rank, role=role, pid=proc.pid,
            shadow_set=self.shadow_set if role is Role.SHADOW else None,
            resume=None if resume is ResumeMode.FRESH else resume, forked=isinstance(proc.popen, ForkedProcess)))
        return proc

    def reset_heartbeats(self) -> None:
        """New trainers for every local rank: no heartbeat of an old one counts for them."""
        for rank in self.spec.local_ranks:
            self.store.set(HEARTBEAT.format(rank=rank), "")
        self.heartbeats.clear()

    def start_actives(self, resume: ResumeMode) -> None:
        self.reset_heartbeats()
        procs = (self._spawn(lr, Role.ACTIVE, resume) for lr in range(self.spec.nproc_per_node))
        self.actives = {p.rank: p for p in procs}

    def start_shadows(self, replacement: int = 0) -> None:
        self.store.set(SHADOWS_READY, "")
        if not self.config.shadows or not self.shadow_level:  # level 0: memory reclaim runs without one
            return
        self.shadow_set = f"{self.job.generation}-{replacement}"
        self.replacements_seen = replacement
        procs = (self._spawn(lr, Role.SHADOW, ResumeMode.FRESH) for lr in range(self.spec.nproc_per_node))
        self.shadows = {p.rank: p for p in procs}
        self.events.write(ShadowLevelReached(generation=self.job.generation, shadow_set=self.shadow_set,
                                             level=self.shadow_level, reason="started"))

    # -- shadows ---------------------------------------------------------------------------------
    def publish_shadow_readiness(self) -> None:
        self._ready_template()  # the template's report on record as soon as it is in
        ranks = range(self.spec.world_size)  # a shadow set is one process group across all nodes
        published = self.store.read(SHADOWS_READY)
        if published is None:  # the agent wrote it: someone deleted it (or overwrote it with a forgery)
            self.control_key_missing(SHADOWS_READY)
            self.store.set(SHADOWS_READY, "")
            published = b""
        if self.shadows and not published and all(
                self.store.check([SHADOW_READY.format(sgen=self.shadow_set, rank=r)]) for r in ranks):
            self.store.set(SHADOWS_READY, str(self.shadow_set))
            self.events.write(ShadowLevelReached(generation=self.job.generation, shadow_set=self.shadow_set,
                                                 level=self.shadow_level, reason="ready"))

    def control_key_missing(self, key: str) -> None:
        """A key the job relies on vanished from its store: a fault of the control plane, on record
        (once per key and generation); the caller carries on without blocking on it."""
        mark = (key, self.job.generation)
        if mark not in self._missing_reported:
            self._missing_reported.add(mark)
            self.events.write(ControlKeyMissing(generation=self.job.generation, key=key))

    def shadows_promotable(self) -> bool:
        """This node's shadow set is alive, not stopped and ready (a stopped (SIGSTOP) shadow
        would only hang: start cold instead)."""
        return bool(self.shadows) and all(
            p.poll() is None and not stopped(p.pid)
            and self.store.check([SHADOW_READY.format(sgen=self.shadow_set, rank=r)])
            for r, p in self.shadows.items())

    def promote_shadows(self) -> None:
        """The shadow set becomes the active trainers of the current generation."""
        self.store.set(PROMOTE.format(sgen=self.shadow_set), Promotion(self.job.generation).to_json())
        for p in self.shadows.values():
            p.role, p.generation = Role.ACTIVE, self.job.generation
        self.actives, self.shadows = self.shadows, {}

    def watch_shadows(self) -> None:
        """A shadow that died while waiting is replaced -- with its whole set, on every node:
        the set is one process group. The replacement counter in the store keeps nodes in step."""
        self.stop.check()  # shadows that died of the process group's SIGTERM are not replaced
        dead = [p for p in self.shadows.values() if p.poll() is not None]
        for p in dead:
            code, sig = p.exit_status()
            self.events.write(ShadowFailed(generation=self.job.generation, rank=p.rank, pid=p.pid, exit_code=code,
                                           signal=sig, shadow_set=p.shadow_set))
        count = self.store.add(SHADOW_REPLACE.format(gen=self.job.generation), 1 if dead else 0)
        if count > self.replacements_seen:
            self.replace_shadows(count)

    def replace_shadows(self, count: int) -> None:
        """Stop the shadow set and start the ``count``-th replacement of this generation."""
        self.replacements_seen = count
        self.stop_shadows()
        self.start_shadows(replacement=count)

    def claim_replacement(self) -> int:
        """Count one replacement of this generation's shadow set as this agent's own (the
        memory policy's level change): ``watch_shadows`` must not redo it."""
        count = self.store.add(SHADOW_REPLACE.format(gen=self.job.generation), 1)
        self.replacements_seen = count
        return count

    # -- stopping --------------------------------------------------------------------------------
    def stop_actives(self) -> None:
        kill(self.actives)
        self.actives = {}

    def stop_shadows(self) -> None:
        kill(self.shadows)
        self.shadows = {}

    def stop_all(self) -> None:
        self.stop_actives()
        self.stop_shadows()

    def running_pids(self) -> list[int]:
        return [p.pid for p in (*self.actives.values(), *self.shadows.values()) if p.poll() is None]


def kill(procs: Mapping[int, TrainerProcess]) -> None:
    """SIGKILL every process first (survivors are blocked in collectives), then reap each."""
    for p in procs.values():
        try:
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs.values():
        p.kill()


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a debugger) rather than waiting in a collective."""
    return process_state(pid) in ("T", "t")
