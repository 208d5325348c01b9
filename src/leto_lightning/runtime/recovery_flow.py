"""What the agent does once a failure is detected: classify, recover in place or restart.

``Recovery`` owns the ``RecoveryPhase`` (``phases.py``: the transitions) and is given exactly
what it works with: the job's identity, the trainers, the detector, the nodes' lockstep, the
store, the event log. Retained state that cannot be used (``RetainedStateError``, or a store
removed from /dev/shm) means a checkpoint restart; anything else is a bug and propagates.

Breakdown recorded for every in-place recovery (seconds; docs/events.md). Consecutive
intervals of one time line, so they add up to ``total_s``:
  detect        failure -> noticed (exit: since the last poll that saw nothing wrong; hang: since
                the last heartbeat, or since the agent began waiting for the first one)
  stop          classify, SIGKILL every active trainer and reap it
  attach_repair attach the node's retained stores, undo-restore, repair, roll forward
  transfer      a lost node's stores sent to (on the source node) or received by (on the spare)
                the spare that takes its place (runtime/transfer.py); 0 on every other node
  start         until the trainers reached ``protect()``: a cold start's process start-up
                (interpreter, imports, process group); a promoted shadow's wake-up
  init          what the promoted trainers still had to build (0 for a ready L3 shadow)
  resume        re-binding to retained state and restoring loop/RNG/data position
  recompute     redoing the interrupted iteration when it failed before its update committed
  next_iteration the first iteration after resuming when nothing was lost (new work: counted
                only because ``total_s`` runs to the first completed iteration)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from datetime import timedelta
from typing import TextIO

from ..console import notice
from ..env import ResumeMode, job_prefix
from ..errors import RetainedStateError
from ..retained.shm import list_segments, new_job_id, segment_name, unlink_segments
from ..retained.store import RetainedStore
from .classify import FailedRole, Failure, classify, device_health, node_lost_failure
from .config import RuntimeConfig
from .control import SignedStore
from .coordination import JobIdentity, NodeLockstep, StopFlag
from .detect import Detector
from .event_types import (
    CheckpointRestartFinished,
    Classification,
    ColdStart,
    FailureDetected,
    FallbackCheckpoint,
    NodeLostEvent,
    RecoveryFailed,
    RecoveryFinished,
    RecoveryStarted,
    ShadowsPromoted,
    StateTransferred,
)
from .events import EventLog
from .keys import FAILURE, FIRST_DONE, RESUMED, SHADOWS_READY, STORE_READY
from .membership import Membership
from .messages import (
    FirstDone,
    NodeAssignment,
    NodeRecovered,
    NodeShadowsReady,
    NodeStopped,
    ResumeInfo,
    TrainerPhase,
    Verdict,
)
from .phases import RECOVERY_TRANSITIONS, JobStopped, NodeLost, NodeRetired, PhaseTracker, RecoveryPhase
from .recovery_books import RecoveryBooks, RecoveryTiming, Resumption
from .repair_step import RepairOutcome, SummaryExchange, repair_node_stores
from .spec import LaunchSpec
from .trainers import Trainers, stopped
from .transfer import TransferReport, plan, receive_node_state, send_node_state
from .xid import XidMonitor

log = logging.getLogger(__name__)
Phase = RecoveryPhase


class Recovery:
    def __init__(self, spec: LaunchSpec, config: RuntimeConfig, store: SignedStore, job: JobIdentity,
                 trainers: Trainers, detector: Detector, lockstep: NodeLockstep, stop: StopFlag,
                 events: EventLog, out: TextIO) -> None:
        self.spec, self.config, self.store, self.job = spec, config, store, job
        self.trainers, self.detector, self.lockstep, self.stop = trainers, detector, lockstep, stop
        self.events, self.out = events, out
        self._phase = PhaseTracker("recovery", Phase.IDLE, RECOVERY_TRANSITIONS)
        self._books: RecoveryBooks | None = None  # open from resuming until every rank's first iteration
        self._failure_times: deque[float] = deque()
        self._startup_failures: set[str] = set()  # the kinds of failure seen before a first heartbeat
        # a checkpoint restart, until every rank's first iteration: (failure time, failed iteration)
        self._restart: tuple[float, int | None] | None = None
        self.xids = XidMonitor()  # the agent's, registered at job start (none: classified without Xids)
        self.membership: Membership | None = None  # a job with spares: lost nodes get one (runtime/membership.py)
        self._incoming: dict[int, NodeAssignment] = {}  # this recovery's lost slots and their spares
        self._joining: NodeAssignment | None = None  # a spare: the slot it takes over in this recovery
        self._transfer_s = 0.0  # this recovery's state transfer (sent or received)

    @property
    def phase(self) -> RecoveryPhase:
        return self._phase.current

    @property
    def busy(self) -> bool:
        """A recovery owns the shadow set (it is handling a failure, or its books are open)."""
        return self.phase is not Phase.IDLE

    def _advance(self, new: RecoveryPhase) -> None:
        old = self._phase.advance(new)
        log.debug("recovery phase %s -> %s (generation %d)", old.name, new.name, self.job.generation)

    # -- one failure, until it is handled ------------------------------------------------------
    def handle(self, failure: Failure) -> None:
        """Recover from ``failure``; a failure during recovery starts the next generation."""
        self.track_first_iteration()
        current: Failure | None = failure
        while current is not None:
            if self.phase is Phase.CONFIRMING:  # failed again before the first iteration after resuming
                self._close_interrupted()
            self._advance(Phase.CLASSIFYING)
            current = self._handle_one(current)
        if self.phase is Phase.RESTARTING:  # else CONFIRMING: the books close on the first iteration
            self._advance(Phase.IDLE)

    def _handle_one(self, failure: Failure) -> Failure | None:
        self.stop.check()
        self._charge_budget(failure)
        gen = self.job.generation
        self.events.write(FailureDetected(
            generation=gen, rank=failure.rank, pid=failure.pid, role=failure.role, exit_code=failure.exit_code,
            signal=failure.signal, exception=failure.exception, hang=failure.hang, phase=failure.phase,
            iteration=failure.iteration))
        if failure.role is FailedRole.NODE:  # its slot gets a spare in the in-place recovery's first step
            return self._in_place(failure)
        verdict = self._job_verdict(failure)
        self.events.write(Classification(generation=gen, rank=failure.rank, hof=verdict.hof, reason=verdict.reason,
                                         device=verdict.device, node=verdict.node))
        notice(f"{failure.describe()}: {'HOF' if verdict.hof else 'not a HOF'} ({verdict.reason})", self.out)
        self._stop_on_repeated_startup_failure(failure)
        if verdict.stop:
            raise JobStopped(f"{failure.describe()}: {verdict.reason}")
        if verdict.hof:
            return self._in_place(failure)
        if verdict.replace:  # the failed node leaves; the others replace it like a lost node
            if verdict.node == self.spec.node_rank:
                self._retire(verdict)
            return self._in_place(failure)
        self._restart = (failure.detected_at, failure.iteration)
        return self._restart_from_checkpoint(f"non-HOF failure: {verdict.reason}")

    def _job_verdict(self, failure: Failure) -> Verdict:
        """Classify locally, then publish: the first node to publish decides for the whole job."""
        if failure.remote_verdict is not None:
            return failure.remote_verdict
        index = self.spec.device_index(failure.rank)
        v = classify(failure, self.config, device_health(index, self.xids.drain().get(index)))
        replace = (not v.hof and not v.stop and self.spec.node_rank != 0 and self.membership is not None
                   and bool(self.membership.free_spares()))
        mine = Verdict(rank=failure.rank, hof=v.hof, reason=v.reason, device=v.device.source,
                       node=self.spec.node_rank, stop=v.stop, replace=replace)
        return Verdict.from_json(self.store.compare_set(FAILURE.format(gen=self.job.generation), "",
                                                        mine.to_json()))

    def _stop_on_repeated_startup_failure(self, failure: Failure) -> None:
        """A trainer that fails the same way before its first heartbeat twice has a configuration
        error (a bad argument, an invalid setting, a missing module): retrying cannot fix it. The
        same way = the same kind (signal, exception type, exit code), whatever the message says."""
        kind = failure.kind() if failure.iteration is None else None
        if kind is None:
            return
        if kind in self._startup_failures:
            proc = self.trainers.actives.get(failure.rank)
            said = failure.exception or (proc.last_line() if proc is not None else "")
            raise JobStopped(f"configuration error: the trainer failed the same way ({kind}) at start-up twice, last: "
                             f"{failure.describe()}{'' if failure.exception or not said else ': ' + said}; it is not "
                             "a hardware failure -- fix the script, its arguments or settings and relaunch")
        self._startup_failures.add(kind)

    def _charge_budget(self, failure: Failure) -> None:
        now = time.time()
        self._failure_times.append(now)
        while self._failure_times and now - self._failure_times[0] > self.config.failure_window:
            self._failure_times.popleft()
        if len(self._failure_times) > self.config.max_failures:
            raise JobStopped(
                f"{len(self._failure_times)} failures within {self.config.failure_window:.0f} s exceed the budget "
                f"of {self.config.max_failures} (last: {failure.describe()}); retained memory is freed, the last "
                "checkpoint (if the script saved one) is intact -- fix the cause and relaunch"
            )

    # -- in place ------------------------------------------------------------------------------
    def join(self, assignment: NodeAssignment) -> None:
        """A spare agent takes over a lost slot: it enters the survivors' in-place recovery of
        ``assignment.generation`` at its first step, with the slot's state coming by transfer."""
        self.job.generation = assignment.generation - 1  # the recovery below enters the assignment's generation
        self._joining = assignment
        self.handle(node_lost_failure([assignment.node], self.spec, "this spare takes its place"))

    def _in_place(self, failure: Failure) -> Failure | None:
        """Recover in place; a node lost meanwhile is the next failure (its slot gets a spare)."""
        try:
            return self._recover_in_place(failure)
        except NodeLost as lost:
            self.events.write(RecoveryFailed(generation=self.job.generation, rank=failure.rank, reason=str(lost)))
            return node_lost_failure(lost.nodes, self.spec, "its agent stopped beating")

    def _recover_in_place(self, failure: Failure) -> Failure | None:
        self._advance(Phase.STOPPING)
        t_fail = failure.hung_since if failure.hang and failure.hung_since else self.detector.last_poll
        t_fail = min(t_fail, failure.detected_at)
        timing = RecoveryTiming(detect=failure.detected_at - t_fail)
        gen = self.job.next_generation()
        self._incoming, self._transfer_s = {}, 0.0
        self.events.write(RecoveryStarted(generation=gen, cause_rank=failure.rank, hof=True))
        self.trainers.stop_actives()
        self._sync_replacing_lost(NodeStopped())  # no node touches retained state while another still trains
        t1 = time.time()
        timing.stop = t1 - failure.detected_at
        self._advance(Phase.REPAIRING)
        repaired = self._repair_job_retained()
        if repaired.problem is not None:
            return self._restart_from_checkpoint(repaired.problem)
        self.stop.check()
        t2 = time.time()
        timing.transfer = self._transfer_s
        timing.attach_repair = t2 - t1 - self._transfer_s
        self._advance(Phase.PROMOTING)
        promoted = self._promote_or_cold_start()
        # what the job recovered from (0: a cold start)
        level = self.trainers.shadow_level if promoted == Resumption.SHADOW else 0
        self._advance(Phase.RESUMING)
        last = self._wait_resumed(timing, t2)
        if isinstance(last, Failure):
            return last
        lost = failure.iteration is not None and failure.phase is TrainerPhase.COMPUTE
        resume_it = repaired.resume_iteration
        self._books = RecoveryBooks(
            timing=timing, t_fail=t_fail, resume_iteration=resume_it, failed_iteration=failure.iteration,
            recomputes=bool(lost and resume_it is not None and failure.iteration is not None
                            and resume_it <= failure.iteration),
            promoted=promoted, shadow_level=level, t_resumed=last.t,
            repair=[r.summary() for r in repaired.reports.values()])
        self._advance(Phase.CONFIRMING)
        if not self.config.defer_shadow_restart:
            self.trainers.start_shadows()  # in the background: training goes on meanwhile
        return None  # deferred: started once the first iteration after resuming completed

    def _retire(self, verdict: Verdict) -> None:
        """This node's failure was not a HOF and a spare is free: stop every trainer, free the
        retained memory (its device is not operable), leave the slot to a spare."""
        self.trainers.stop_all()
        unlink_segments(self.job.job_id)
        assert self.membership is not None  # a verdict says replace only with spares
        self.membership.retire()
        raise NodeRetired(f"node {self.spec.node_rank} leaves the job ({verdict.reason}): a spare takes its place")

    def _sync_replacing_lost(self, message: NodeStopped) -> None:
        """The recovery's first lockstep step; a lost node's slot is given a spare, which
        then takes this step in its place."""
        while True:
            try:
                self.lockstep.sync(message)
                return
            except NodeLost as lost:
                for node in lost.nodes:
                    self._replace(node)

    def _replace(self, node: int) -> None:
        gen = self.job.generation
        holder = self.membership.holder(node) if self.membership is not None else node
        assignment = self.membership.claim_spare(node, gen) if self.membership is not None and node else None
        self.events.write(NodeLostEvent(generation=gen, node=node, agent=holder,
                                        spare=assignment.spare if assignment is not None else None))
        if assignment is None:
            why = ("it hosts the job's store" if node == 0 else
                   f"no spare is left (--spares {self.spec.spares}: every one in use or gone)")
            raise JobStopped(f"node {node} lost (its agent stopped beating for {self.config.node_timeout:.0f} s) and "
                             f"cannot be replaced: {why}. The job cannot go on at its size: relaunch it, the script "
                             "resumes from its last checkpoint")
        notice(f"node {node} lost: spare agent {assignment.spare} takes its place with its ranks' state from the "
               "other nodes", self.out)
        self._incoming[node] = assignment

    def _repair_job_retained(self) -> RepairOutcome:
        """Repair this node's retained stores; then every node learns whether all of them could
        (else all restart from the checkpoint) and the job's resume iteration. A lost node's
        state moves to its spare first (``runtime/transfer.py``), and the spare repairs with the
        others; a transfer that fails unblocks the job-wide decision (``SummaryExchange.fail``)."""
        reports: dict = {}
        joining, self._joining = self._joining, None
        problem = None if joining is not None else self._unready_store()
        try:
            transfer_problem = self._receive_state(joining) if joining is not None else \
                (self._send_state() if problem is None else None)
            if transfer_problem is not None:
                problem = transfer_problem
                SummaryExchange(self.spec.node_rank, self.lockstep).fail(transfer_problem)
            elif problem is None:
                reports = repair_node_stores(self.job.job_id, self.spec, self.lockstep)
        except FileNotFoundError as exc:
            problem = (f"retained memory removed after set-up ({exc.filename or exc} is missing from /dev/shm): "
                       "something freed it while the job ran")
        except RetainedStateError as exc:  # incomplete, damaged beyond parity, no consistent iteration
            problem = f"retained state unusable: {exc}"
        resume = min((r.resume_iteration for r in reports.values()), default=None)
        mine = NodeRecovered(problem, resume)
        parts = self.lockstep.sync(mine) if self.spec.nnodes > 1 else [mine]
        problems = [p.problem for p in parts if p.problem]
        resumes = [p.resume for p in parts if p.resume is not None]
        if not problems and not resumes:
            problems = ["no node repaired any retained store"]
        return RepairOutcome(reports, min(resumes, default=None), problems[0] if problems else None)

    def _receive_state(self, assignment: NodeAssignment) -> str | None:
        """A joining spare: its slot's stores from the source node (then it repairs with the
        others), or why they cannot come."""
        if assignment.generation != self.job.generation:  # another failure came first: the source sends nothing
            return (f"the replacement of node {assignment.node} was interrupted by another failure before its state "
                    "arrived: no state to resume from")
        report = receive_node_state(self.store, self.job.job_id, self.spec.local_ranks, assignment.node,
                                    assignment.generation, timedelta(seconds=self.config.startup_timeout))
        return self._record_transfer(report, "receiver")

    def _send_state(self) -> str | None:
        """Each lost node's source (``transfer.plan``: a replica's first survivor, or the lost
        node's successor for the cross-node tier's copy) sends to its spare; the first survivor
        sends the reason when there is no source."""
        incoming, self._incoming = self._incoming, {}
        if not incoming:
            return None
        survivors = [n for n in range(self.spec.nnodes) if n not in incoming]
        first = RetainedStore.attach(self.job.job_id, self.spec.repair_ranks[0])
        spec = first.spec
        first.close()
        for node, assignment in sorted(incoming.items()):
            how = plan(spec, node, set(incoming), self.spec.nnodes)
            if self.spec.node_rank != (how.source if how.source is not None else survivors[0]):
                continue
            report = send_node_state(self.store, self.job.job_id, self.spec.local_ranks, how, assignment.generation,
                                     timedelta(seconds=self.config.startup_timeout))
            problem = self._record_transfer(report, "source")
            if problem is not None:
                return problem
        return None

    def _record_transfer(self, report: TransferReport, side: str) -> str | None:
        """One side of a transfer into the books and the event log; why it failed, if it did."""
        self._transfer_s += report.seconds
        self.events.write(StateTransferred(
            generation=self.job.generation, node=report.node, source=report.source, side=side, bytes=report.nbytes,
            seconds=round(report.seconds, 4), pages_verified=report.pages_verified if side == "receiver" else None,
            problem=report.problem))
        return None if report.problem is None else f"state transfer to the spare of node {report.node}: " \
                                                    f"{report.problem}"

    def _unready_store(self) -> str | None:
        """Why the stores this agent repairs cannot be used for resuming, if one never got its
        ready mark (``STORE_READY``, set once it was completely initialised and protected)."""
        job_id = self.job.job_id
        unready = [r for r in self.spec.repair_ranks
                   if not self.store.check([STORE_READY.format(job=job_id, rank=r)])]
        if not unready:
            return None
        if any(list_segments(segment_name(job_id, f"r{r}", "")) for r in unready):
            return (f"retained state incomplete: the store of rank(s) {unready} was never completely initialised and "
                    "protected (a trainer died during set-up)")
        return "no retained state yet (the failure came before it was created)"

    def _promote_or_cold_start(self) -> Resumption:
        t = self.trainers
        every_node = self.lockstep.sync(NodeShadowsReady(t.shadows_promotable()))
        ready = all(m.ready for m in every_node)  # promote only if every node can
        t.reset_heartbeats()
        self.store.set(SHADOWS_READY, "")
        gen = self.job.generation
        if ready:
            t.promote_shadows()
            self.events.write(ShadowsPromoted(generation=gen, shadow_set=t.shadow_set))
            return Resumption.SHADOW
        t.stop_shadows()
        t.start_actives(resume=ResumeMode.RETAINED)
        self.events.write(ColdStart(generation=gen,
                                    reason="no ready shadow set: new trainers attach to retained state"))
        return Resumption.COLD

    def _wait_resumed(self, timing: RecoveryTiming, t_repaired: float) -> Failure | ResumeInfo:
        """Until every active trainer resumed: the last one's ``ResumeInfo`` (the rank the job
        waited for), or the failure that came first (a resume past the start-up timeout: a hang)."""
        waiting_since = time.time()
        deadline = waiting_since + self.config.startup_timeout
        actives = self.trainers.actives
        pending = set(actives)
        infos: dict[int, ResumeInfo] = {}
        while pending:
            for r in list(pending):
                resumed = self.store.read(RESUMED.format(gen=self.job.generation, rank=r))
                if resumed is not None:
                    infos[r] = ResumeInfo.from_json(resumed)
                    pending.discard(r)
            failure = self.detector.detect()
            if failure is not None:
                self.events.write(RecoveryFailed(generation=self.job.generation, rank=failure.rank,
                                                 reason=failure.describe()))
                return failure
            if time.time() > deadline:  # blame a stopped trainer, not the healthy one waiting for it
                p = min((actives[r] for r in pending), key=lambda p: (not stopped(p.pid), p.rank))
                return self.detector.failure(p, hang=True, waiting_since=waiting_since)
            self.stop.wait(self.config.poll_interval)
        last = max(infos.values(), key=lambda i: i.t)  # the rank the job waited for
        timing.init, timing.resume = last.init_s, last.resume_s
        timing.start = max(0.0, last.t - t_repaired - last.init_s - last.resume_s)
        return last

    # -- the books of a recovery ---------------------------------------------------------------
    def track_first_iteration(self) -> None:
        """Close a recovery's books when every rank finished an iteration after resuming."""
        if self._restart is not None:
            self._track_restart()
        rec = self._books
        if rec is None:
            return
        gen = self.job.generation
        done = [self.store.read(FIRST_DONE.format(gen=gen, rank=r)) for r in self.trainers.actives]
        if any(d is None for d in done):
            return
        now = max(FirstDone.from_json(d).t for d in done if d is not None)
        first = now - rec.t_resumed
        breakdown = rec.timing.rounded()
        breakdown["recompute"] = round(first if rec.recomputes else 0.0, 4)
        breakdown["next_iteration"] = round(0.0 if rec.recomputes else first, 4)
        total = now - rec.t_fail  # failure -> first completed iteration: the sum of the breakdown
        self.events.write(RecoveryFinished(
            generation=gen, breakdown=breakdown, first_iteration_s=round(first, 4), total_s=round(total, 4),
            resume_iteration=rec.resume_iteration, failed_iteration=rec.failed_iteration, promoted=rec.promoted,
            repair=rec.repair, shadow_level=rec.shadow_level))
        self._books = None
        self._advance(Phase.IDLE)
        if self.config.defer_shadow_restart:
            self.trainers.start_shadows()
        notice(f"recovered in place (generation {gen}): resumed at iteration {rec.resume_iteration}, "
               f"{total:.2f} s to the first iteration after the failure {breakdown}", self.out)

    def _track_restart(self) -> None:
        """A checkpoint restart's cost, once every rank finished its first iteration after it:
        ``checkpoint_restart_finished`` with the seconds from the failure and the iterations the
        job must now compute again (those after the checkpoint up to the failed one)."""
        assert self._restart is not None
        gen = self.job.generation
        done = [self.store.read(FIRST_DONE.format(gen=gen, rank=r)) for r in self.trainers.actives]
        if not done or any(d is None for d in done):
            return
        t_fail, failed = self._restart
        self._restart = None
        firsts = [FirstDone.from_json(d) for d in done if d is not None]
        first = min(f.it for f in firsts)
        now = max(f.t for f in firsts)
        self.events.write(CheckpointRestartFinished(
            generation=gen, total_s=round(now - t_fail, 4), failed_iteration=failed, first_iteration=first,
            recompute_iterations=(failed - first) if failed is not None else None))

    def _close_interrupted(self) -> None:
        """A failure before every rank's first iteration after resuming: the recovery's books
        close as interrupted (its shadows, if deferred, are never started: the next one decides)."""
        rec = self._books
        if rec is not None:
            self.events.write(RecoveryFinished(
                generation=self.job.generation, interrupted=True, first_iteration_s=None,
                breakdown=rec.timing.rounded(), resume_iteration=rec.resume_iteration,
                failed_iteration=rec.failed_iteration, promoted=rec.promoted))
        self._books = None

    # -- the slow path -------------------------------------------------------------------------
    def _restart_from_checkpoint(self, reason: str) -> Failure | None:
        """Everything restarts; the script resumes from its last checkpoint."""
        self._advance(Phase.RESTARTING)
        gen = self.job.next_generation()
        self.events.write(FallbackCheckpoint(generation=gen, reason=reason))
        notice(f"restarting from the last checkpoint: {reason}", self.out)
        self.trainers.stop_all()
        self._books = None
        unlink_segments(self.job.job_id)
        self.job.replace_job_id(self.lockstep.shared_job_id(new_job_id(job_prefix())))
        self.trainers.start_actives(resume=ResumeMode.CHECKPOINT)
        self.trainers.start_shadows()
        return None
