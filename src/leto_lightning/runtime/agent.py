"""The per-node agent of ``leto launch``: starts the trainers, watches them, recovers.

Lifecycle of one failure (docs/design.md section 2.5)::

    detect (exit / hang) -> classify -> HOF: stop every active trainer -> new generation ->
    recover retained state (undo-restore, repair, roll forward) -> promote the shadows (or start
    cold trainers that attach) -> wait until every rank resumed -> start fresh shadows
    non-HOF (or damage beyond parity): stop everything -> checkpoint restart
    a lost node (``--spares``: its agent stopped beating): a spare takes its slot, receives its
        ranks' state from a replica or the cross-node tier, and joins the in-place recovery

A failure while recovering simply starts the next generation. Every step is in the event log.

The agent is assembled from parts, each given only what it uses: ``Trainers`` (the processes),
``Detector`` (one poll of them), ``Recovery`` (a failure, until it is handled), ``NodeLockstep``
(waiting for the other nodes), ``ShadowReclaimer`` (memory). The agent owns the ``JobPhase``
(``phases.py``); ``Recovery`` owns the ``RecoveryPhase``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import TextIO

import torch.distributed as dist

from ..console import notice, say
from ..env import ResumeMode, job_prefix
from ..errors import ConfigurationError
from ..retained.shm import new_job_id, unlink_segments
from .auth import job_key, job_secret
from .config import RuntimeConfig
from .control import SignedStore, host_store
from .coordination import JobIdentity, NodeLockstep, StopFlag
from .detect import Detector
from .event_types import (
    ControlMessageRejected,
    JobFinished,
    JobStarted,
    RunDirLockTakenOver,
    SpareJoined,
)
from .event_types import JobInterrupted as JobInterruptedEvent  # phases.JobInterrupted: the exception
from .event_types import JobStopped as JobStoppedEvent
from .event_types import NodeRetired as NodeRetiredEvent  # phases.NodeRetired: the exception
from .events import EventLog
from .membership import AgentBeat, Membership, beat_interval
from .messages import NodeAssignment
from .phases import JOB_TRANSITIONS, JobInterrupted, JobPhase, JobStopped, NodeRetired, PhaseTracker
from .reclaim import ReclaimConfig, ReclaimPolicy, ShadowReclaimer, check_supported
from .recovery_flow import Recovery
from .rundir import claim as claim_run_dir
from .spec import LaunchSpec
from .state_managers import NodeStateManagers
from .storage import StorageError
from .trainers import Trainers
from .worker_env import omp_defaults, omp_notice
from .xid import XidMonitor

__all__ = ["Agent", "JobInterrupted", "JobStopped", "LaunchSpec"]
log = logging.getLogger(__name__)


@dataclass
class _Parts:
    """What runs once the job's store is up."""

    store: SignedStore
    lockstep: NodeLockstep
    trainers: Trainers
    detector: Detector
    recovery: Recovery
    reclaimer: ShadowReclaimer | None


class Agent:
    def __init__(self, spec: LaunchSpec, config: RuntimeConfig | None = None, out: TextIO | None = None,
                 reclaim: ReclaimConfig | None = None) -> None:
        spec.preflight()
        if reclaim is not None:
            check_supported(spec)  # refused before the run dir is claimed
        self.spec = spec
        self.config = config or RuntimeConfig()
        self.out = out or sys.stdout
        self._reclaim = reclaim
        # one live job per run dir; 0700 and umask 077 before anything is written there
        self.run_dir_claim = claim_run_dir(spec.run_dir, spec.run_dir_mode, spec.events_dir, spec.node_rank)
        self.events = EventLog(spec.events_dir)
        if self.run_dir_claim.previous:
            self.events.write(RunDirLockTakenOver(generation=0, previous=self.run_dir_claim.previous))
        self.job = JobIdentity(new_job_id(job_prefix()))
        self.stop = StopFlag()
        self._phase = PhaseTracker("job", JobPhase.STARTING, JOB_TRANSITIONS)
        self._parts: _Parts | None = None
        self.port = 0
        self.thread_defaults = omp_defaults(spec.nproc_per_node)  # torchrun's rule, decided once
        self.state_managers = NodeStateManagers({})  # CUDA memory owners, launched with the job
        self.xids = XidMonitor()  # GPU Xid events, registered with the job
        self._policy = ReclaimPolicy.for_launch(reclaim, self.config) if reclaim is not None else None
        self._beat: AgentBeat | None = None  # a job with spares: this agent's beat (runtime/membership.py)
        self._warm: Trainers | None = None  # a spare: holds its warm template until it takes over

    @property
    def phase(self) -> JobPhase:
        return self._phase.current

    def _advance(self, new: JobPhase) -> None:
        old = self._phase.advance(new)
        log.debug("job phase %s -> %s (generation %d)", old.name, new.name, self.job.generation)

    # -- the main loop ---------------------------------------------------------------------
    def run(self) -> int:
        import torch

        # The agent's own tensor work (roll-forward, repair) must not fight the trainers for
        # cores: measured 2.8 s vs 0.2 s for one repair on a loaded 2-core machine.
        torch.set_num_threads(1)
        omp = omp_notice(self.thread_defaults)
        if omp is not None:  # torchrun's notice, once per launch
            say(omp, self.out)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            parts = self._start()
            if parts is None:  # a spare the job finished without
                return 0
            self._advance(JobPhase.RUNNING)
            return self._loop(parts)
        except NodeRetired as exc:  # its part of the job goes on on a spare
            self._advance(JobPhase.STOPPED)
            self.events.try_write(NodeRetiredEvent(generation=self.job.generation, reason=str(exc)))
            notice(str(exc), self.out)
            return 0
        except JobInterrupted as exc:
            self._advance(JobPhase.INTERRUPTED)
            self.events.try_write(JobInterruptedEvent(generation=self.job.generation, signal=exc.signum))
            notice(f"job {exc}: trainers stopped, retained memory freed", self.out)
            return 128 + exc.signum
        except (JobStopped, StorageError, dist.DistNetworkError) as exc:  # a full run dir: no restart can help
            reason = str(exc) if not isinstance(exc, dist.DistNetworkError) else (
                "the job's store is gone (node 0's agent stopped or its machine was lost): "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
            self._advance(JobPhase.STOPPED)
            self.events.try_write(JobStoppedEvent(generation=self.job.generation, reason=reason))
            notice(f"job stopped: {reason}", self.out)
            return 3
        finally:
            self._shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self) -> _Parts | None:
        """The store, this agent's beat (a job with spares), the parts, the first trainers -- or,
        a spare, its wait for a lost node to take over (None: the job finished without it)."""
        store = self._start_store()
        membership = Membership(store, self.spec, self.config.node_timeout, self.config.startup_timeout)
        if membership.watching:
            self._beat = AgentBeat(self._signed_client(), self.spec.node_rank,
                                   beat_interval(self.config.node_timeout)).start()
        assignment = None
        if self.spec.is_spare:
            assignment = self._wait_as_spare(store, membership)
            if assignment is None:
                self._advance(JobPhase.RUNNING)
                self._advance(JobPhase.FINISHED)
                return None
        parts = self._parts = self._assemble(store, membership)
        self.job.agreed(parts.lockstep.shared_job_id(self.job.job_id))
        self.state_managers = NodeStateManagers.launch(self.spec.run_dir, self.job.job_id,
                                                     range(self.spec.nproc_per_node))
        parts.trainers.cuda_manager = self.state_managers.address
        parts.recovery.xids = self.xids = XidMonitor.start()
        if self.xids.note and self.state_managers.managers:  # a CUDA build: the job may train on GPUs
            notice(self.xids.note, self.out)
        self.events.write(JobStarted(generation=0, port=self.port, world_size=self.spec.world_size,
                                     job_id=self.job.job_id, node_rank=self.spec.node_rank,
                                     script=self.spec.script, pid=os.getpid()))
        if assignment is not None:  # a spare taking over a lost node: it joins the survivors' recovery
            if self._warm is not None:
                parts.trainers.template, self._warm.template = self._warm.template, None
            parts.recovery.join(assignment)
        else:
            parts.trainers.start_actives(resume=ResumeMode.FRESH)
            parts.trainers.start_shadows()
            parts.trainers.start_template()  # imports beside the first trainers; later ones fork from it
        return parts

    def _loop(self, parts: _Parts) -> int:
        while True:
            self.stop.check()
            parts.recovery.track_first_iteration()
            finished = parts.detector.finished()
            if finished is not None:
                parts.lockstep.wait_other_nodes_done()
                self.events.write(JobFinished(generation=self.job.generation, exit_code=finished,
                                              recoveries=self.job.generation))
                self._advance(JobPhase.FINISHED)
                return finished
            failure = parts.detector.detect()
            if failure is not None:
                self._advance(JobPhase.RECOVERING)
                parts.recovery.handle(failure)
                self._advance(JobPhase.RUNNING)
            else:
                parts.trainers.watch_shadows()
                parts.trainers.publish_shadow_readiness()
                if parts.reclaimer is not None:
                    parts.reclaimer.poll()
            self.stop.wait(self.config.poll_interval)

    def _wait_as_spare(self, store: SignedStore, membership: Membership) -> NodeAssignment | None:
        """A spare: warm up (the script's imports in a warm template) and wait until a lost
        node's slot is assigned to it; then this agent is that node's (``self.spec``)."""
        t0 = time.time()
        launch = self.spec.node_rank
        self._warm = self._trainers(self.spec.taking_over(self.spec.nnodes - 1), store)  # only for the template
        self._warm.start_template()
        notice(f"spare agent {launch}: warm, waiting to take over a lost node", self.out)
        assignment = membership.wait_assignment(self.stop.check, self.config.poll_interval)
        if assignment is None:
            notice(f"spare agent {launch}: the job finished without needing it", self.out)
            return None
        self.spec = self.spec.taking_over(assignment.node)
        self.events.write(SpareJoined(generation=assignment.generation, node=assignment.node, spare=launch,
                                      waited_s=round(time.time() - t0, 4)))
        notice(f"spare agent {launch}: takes over node {assignment.node}", self.out)
        return assignment

    def _trainers(self, spec: LaunchSpec, store: SignedStore) -> Trainers:
        c, policy = self.config, self._policy
        level = (lambda: int(policy.level)) if policy is not None else (lambda: c.shadow_level)
        return Trainers(spec, c, self.job, store, self.events, self.out, self.stop, self.secret, self.port,
                        self.thread_defaults, level)

    def _signed_client(self) -> SignedStore:
        """A connection of its own to the job's store (for the agent's beat thread)."""
        s = self.spec
        raw: dist.Store = dist.TCPStore(s.master_addr, self.port, world_size=None, is_master=False,
                                        timeout=timedelta(seconds=60), wait_for_workers=False)
        if s.store_prefix:
            raw = dist.PrefixStore(s.store_prefix, raw)
        return SignedStore(raw, self.secret, s.store_prefix, self._message_rejected)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stop.request(signum)

    # -- assembly --------------------------------------------------------------------------
    def _start_store(self) -> SignedStore:
        s = self.spec
        if s.nnodes > 1 and not s.master_port:
            raise ConfigurationError("a multi-node job needs --master-port (the same on every node)")
        try:
            if s.node_rank == 0 and not s.external_store:  # listens on --master-addr only (loopback by default)
                store, _ = host_store(s.master_addr, s.master_port, timedelta(seconds=60))
            else:
                store = dist.TCPStore(s.master_addr, s.master_port, world_size=None, is_master=False,
                                      timeout=timedelta(seconds=60), wait_for_workers=False)
        except (dist.DistError, OSError) as exc:  # DistNetworkError / DistStoreError: cannot host or reach it
            raise ConfigurationError(_store_problem(s, exc)) from exc
        self.port = store.port
        raw: dist.Store = dist.PrefixStore(s.store_prefix, store) if s.store_prefix else store
        secret = job_secret(raw, s.node_rank, s.nnodes, s.run_dir, s.secret_file, self.config.startup_timeout,
                            self.stop.check)
        # what agents and trainers sign with: a key of this launch (a shared secret is not enough
        # to forge or replay across jobs)
        self.secret = job_key(raw, s.node_rank, secret, self.config.startup_timeout, self.stop.check)
        return SignedStore(raw, self.secret, s.store_prefix, self._message_rejected)

    def _assemble(self, store: SignedStore, membership: Membership) -> _Parts:
        s, c = self.spec, self.config
        policy = self._policy
        watched = membership if membership.watching else None
        lockstep = NodeLockstep(store, s, self.job, self.stop, c.startup_timeout, c.poll_interval, watched)
        trainers = self._trainers(s, store)
        detector = Detector(s, c, store, self.job, trainers, self.stop)
        recovery = Recovery(s, c, store, self.job, trainers, detector, lockstep, self.stop, self.events, self.out)
        detector.membership = recovery.membership = watched
        reclaimer = None
        if self._reclaim is not None and policy is not None:
            reclaimer = ShadowReclaimer(self._reclaim, policy, trainers, self.job, store, self.events, self.out,
                                        busy=lambda: recovery.busy)
        return _Parts(store, lockstep, trainers, detector, recovery, reclaimer)

    def _message_rejected(self, key: str, reason: str) -> None:
        """A control message without the job's secret (or a replay): ignored, and on record."""
        self.events.write(ControlMessageRejected(generation=self.job.generation, key=key, reason=reason,
                                                 reader="agent", pid=os.getpid()))

    def _shutdown(self) -> None:
        parts = self._parts
        if parts is not None:
            parts.trainers.stop_all()
            parts.trainers.close_template()
        if self._warm is not None:
            self._warm.close_template()
        if self._beat is not None:
            self._beat.close()
        for job in self.job.all_job_ids:
            unlink_segments(job)
        self.state_managers.shutdown()  # frees the retained device memory
        self.xids.close()
        if parts is not None and parts.reclaimer is not None:
            parts.reclaimer.close()
        self.events.close()
        self.run_dir_claim.release()


def _store_problem(s: LaunchSpec, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"{s.master_addr}:{s.master_port}"
    if "address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc):
        return f"--master-port {s.master_port} is already in use: choose a free port, or 0 for any ({first})"
    if s.node_rank == 0 and not s.external_store:
        return f"cannot host the job's store on {where} ({first}): check --master-addr and --master-port"
    return f"cannot reach the job's store at {where} ({first}): start node 0 first, check --master-addr/--master-port"

