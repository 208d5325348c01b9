"""What the agent does once a failure is detected (the methods of ``Agent`` that recover).

Breakdown recorded for every in-place recovery (seconds; docs/events.md). Consecutive
intervals of one time line, so they add up to ``total_s``:
  detect        failure -> noticed (exit: since the last poll that saw nothing wrong; hang: since
                the last heartbeat)
  stop          classify, SIGKILL every active trainer and reap it
  attach_repair attach the node's retained stores, undo-restore, repair, roll forward
  start         until the trainers reached ``protect()``: a cold start's process start-up
                (interpreter, imports, process group); a promoted shadow's wake-up
  init          what the promoted trainers still had to build (0 for a ready L3 shadow)
  resume        re-binding to retained state and restoring loop/RNG/data position
  recompute     redoing the interrupted iteration when it failed before its update committed
  next_iteration the first iteration after resuming when nothing was lost (new work: counted
                only because ``total_s`` runs to the first completed iteration)
"""

from __future__ import annotations

import json
import time

from ..errors import RetainedStateError
from ..protection.errors import ProtectionError
from ..retained.shm import list_segments, new_job_id, segment_name, unlink_segments
from ..retained.store import RetainedStore
from ..updater.recovery import local_agreement, recover_node
from . import keys
from .classify import Failure, classify, device_health

FAILED = "failed"  # a node's recovery summary that says its repair failed (never a rank number)
BREAKDOWN = ("detect", "stop", "attach_repair", "start", "init", "resume")  # + "recompute" once known


class RecoveryMixin:
    def _handle(self, failure: Failure) -> None:
        """Recover from ``failure``; a failure during recovery starts the next generation."""
        self._track_first_iteration()
        if self.pending_recovery is not None:  # failed again before the first iteration after resuming
            self.events.emit("recovery_finished", self.generation, interrupted=True, first_iteration_s=None,
                             breakdown={k: round(self.pending_recovery[k], 4) for k in BREAKDOWN},
                             resume_iteration=self.pending_recovery["resume_iteration"],
                             failed_iteration=self.pending_recovery["failed_iteration"],
                             promoted=self.pending_recovery["promoted"])
            self.pending_recovery = None
        while failure is not None:
            self._check_stop()
            self._charge_budget(failure)
            self.events.emit("failure_detected", self.generation, rank=failure.rank, pid=failure.pid,
                             role=failure.role, exit_code=failure.exit_code, signal=failure.signal,
                             exception=failure.exception, hang=failure.hang, phase=failure.phase,
                             iteration=failure.iteration)
            verdict = self._job_verdict(failure)
            self.events.emit("classification", self.generation, rank=failure.rank, hof=verdict["hof"],
                             reason=verdict["reason"], device=verdict["device"], node=verdict["node"])
            print(f"[leto] {failure.describe()}: {'HOF' if verdict['hof'] else 'not a HOF'} ({verdict['reason']})",
                  file=self.out, flush=True)
            self._stop_on_repeated_startup_failure(failure)
            if verdict.get("stop"):
                from .agent import JobStopped

                raise JobStopped(f"{failure.describe()}: {verdict['reason']}")
            if verdict["hof"]:
                failure = self._recover_in_place(failure)
            else:
                failure = self._restart_from_checkpoint(f"non-HOF failure: {verdict['reason']}")

    def _job_verdict(self, failure: Failure) -> dict:
        """Classify locally, then publish: the first node to publish decides for the whole job."""
        if failure.remote_verdict is not None:
            return failure.remote_verdict
        v = classify(failure, self.config, device_health(self._device_index(failure.rank)))
        mine = json.dumps({"rank": failure.rank, "hof": v.hof, "reason": v.reason, "device": v.device.source,
                           "node": self.spec.node_rank, "stop": v.stop})
        return json.loads(self.store.compare_set(keys.FAILURE.format(gen=self.generation), "", mine))

    def _node_sync(self, step: str, value) -> list:
        """Lockstep point of a recovery across the job's node agents; returns every node's value."""
        for node in range(self.spec.nnodes):
            key = keys.NODE_STEP.format(gen=self.generation, step=step, node=node)
            if node == self.spec.node_rank:
                self.store.set(key, json.dumps(value))
        keys_all = [keys.NODE_STEP.format(gen=self.generation, step=step, node=n) for n in range(self.spec.nnodes)]
        self._wait_keys(keys_all, f"every node's agent to reach recovery step {step!r}")
        return [json.loads(self.store.get(k)) for k in keys_all]

    def _stop_on_repeated_startup_failure(self, failure: Failure) -> None:
        """A trainer that exits the same way before its first heartbeat twice has a configuration
        error (a bad argument, an invalid setting, a missing module): retrying cannot fix it."""
        if failure.iteration is not None or failure.exit_code is None or failure.pid is None:
            return
        proc = self.actives.get(failure.rank)
        said = failure.exception or (proc.last_line() if proc is not None else "") or ""
        signature = (failure.exit_code, said)
        if signature in self._startup_failures:
            from .agent import JobStopped

            raise JobStopped(f"configuration error: the trainer failed the same way at start-up twice "
                             f"(exit code {failure.exit_code}{': ' + said if said else ''}); it is not a hardware "
                             "failure -- fix the script, its arguments or settings and relaunch")
        self._startup_failures.add(signature)

    def _agree(self, summary: dict) -> tuple:
        """Job-wide roll-forward or rollback decision from every node's ``{rank: (status, iteration, open)}``.
        A node whose repair failed before it got here sends ``FAILED`` instead: every node raises."""
        self._summary_sent = True
        merged = {}
        for part in self._node_sync("summary", {str(k): v for k, v in summary.items()}):
            if FAILED in part:
                raise RuntimeError(f"retained state unusable on another node ({part[FAILED]})")
            merged.update({int(k): v for k, v in part.items()})
        return local_agreement(merged)

    def _charge_budget(self, failure: Failure) -> None:
        now = time.time()
        self.failure_times.append(now)
        while self.failure_times and now - self.failure_times[0] > self.config.failure_window:
            self.failure_times.popleft()
        if len(self.failure_times) > self.config.max_failures:
            from .agent import JobStopped

            raise JobStopped(
                f"{len(self.failure_times)} failures within {self.config.failure_window:.0f} s exceed the budget of "
                f"{self.config.max_failures} (last: {failure.describe()}); retained memory is freed, the last "
                "checkpoint (if the script saved one) is intact -- fix the cause and relaunch"
            )

    def _recover_in_place(self, failure: Failure) -> Failure | None:
        t_fail = failure.last_heartbeat if failure.hang and failure.last_heartbeat else self._last_poll
        t_fail = min(t_fail, failure.detected_at)
        timing = {"detect": failure.detected_at - t_fail}
        self.generation += 1
        self.events.emit("recovery_started", self.generation, cause_rank=failure.rank, hof=True)
        self._kill(self.actives)
        self.actives = {}
        self._node_sync("stopped", True)  # no node touches retained state while another still trains
        t1 = time.time()
        timing["stop"] = t1 - failure.detected_at
        reports, resume_it, problem = self._recover_job_retained()
        if problem is not None:
            return self._restart_from_checkpoint(problem)
        self._check_stop()
        t2 = time.time()
        timing["attach_repair"] = t2 - t1
        promoted = self._promote_or_cold_start()
        level = self._shadow_level() if promoted == "shadow" else 0  # what the job recovered from (0: cold)
        outcome = self._wait_resumed(timing, t2)
        if isinstance(outcome, Failure):
            return outcome
        lost = failure.iteration is not None and failure.phase == "compute"
        self.pending_recovery = dict(timing, t_fail=t_fail, resume_iteration=resume_it, failed_iteration=failure.iteration,
                                     recomputes=bool(lost and resume_it <= failure.iteration), promoted=promoted,
                                     shadow_level=level,
                                     t_resumed=max(i["t"] for i in outcome.values()),
                                     repair=[r.summary() for r in reports.values()])
        if self.config.defer_shadow_restart:
            self._shadows_due = True  # started once the first iteration after resuming completed
        else:
            self._start_shadows()  # in the background: training goes on meanwhile
        return None

    def _recover_job_retained(self) -> tuple[dict, int | None, str | None]:
        """Repair this node's retained stores; then every node learns whether all of them could
        (else all restart from the checkpoint) and the job's resume iteration."""
        reports, problem = {}, self._unready_store()
        try:
            reports = self._recover_retained() if problem is None else {}
        except FileNotFoundError as exc:
            problem = (f"retained memory removed after set-up ({exc.filename or exc} is missing from /dev/shm): "
                       "something freed it while the job ran")
        except RetainedStateError as exc:  # incomplete, damaged beyond parity, no consistent iteration
            problem = f"retained state unusable: {exc}"
        except (ProtectionError, RuntimeError) as exc:
            problem = f"retained state unusable: {exc}"
        mine = {"problem": problem, "resume": min((r.resume_iteration for r in reports.values()), default=None)}
        parts = self._node_sync("recovered", mine) if self.spec.nnodes > 1 else [mine]
        problems = [p["problem"] for p in parts if p["problem"]]
        resumes = [p["resume"] for p in parts if p["resume"] is not None]
        if not problems and not resumes:
            problems = ["no node repaired any retained store"]
        return reports, min(resumes, default=None), problems[0] if problems else None

    def _unready_store(self) -> str | None:
        """Why the stores this agent repairs cannot be used for resuming, if one never got its
        ready mark (``keys.STORE_READY``, set once it was completely initialised and protected)."""
        unready = [r for r in self._repair_ranks() if not self.store.check([keys.STORE_READY.format(job=self.job_id,
                                                                                                   rank=r)])]
        if not unready:
            return None
        if any(list_segments(segment_name(self.job_id, f"r{r}", "")) for r in unready):
            return (f"retained state incomplete: the store of rank(s) {unready} was never completely initialised and "
                    "protected (a trainer died during set-up)")
        return "no retained state yet (the failure came before it was created)"

    def _repair_ranks(self) -> list[int]:
        """The ranks whose stores this agent repairs: its node's. A per-rank agent (torchrun,
        srun) of local rank 0 repairs every store of its machine (tier-2 parity spans them);
        the other per-rank agents repair none and only take part in the agreement."""
        layout = self.spec.trainer_layout
        if layout is None:
            return self._local_ranks()
        local_rank, local_world_size, _node = layout
        return [] if local_rank else list(range(self.spec.node_rank, self.spec.node_rank + local_world_size))

    def _recover_retained(self) -> dict:
        self._summary_sent = False
        ranks = self._repair_ranks()
        if not ranks:
            self._agree({})
            return {}
        stores = {}
        try:
            for local, rank in enumerate(ranks):
                stores[local] = RetainedStore.attach(self.job_id, rank)
            return recover_node(stores, agree=self._agree)
        except Exception as exc:
            if not self._summary_sent:  # the other nodes wait for this node's summary: unblock them
                self._node_sync("summary", {FAILED: f"node {self.spec.node_rank}: {type(exc).__name__}: {exc}"})
            raise
        finally:
            for s in stores.values():
                s.close()

    def _promote_or_cold_start(self) -> str:
        from .agent import _stopped

        ready = bool(self.shadows) and all(  # a stopped (SIGSTOP) shadow would only hang: start cold instead
            p.poll() is None and not _stopped(p.pid)
            and self.store.check([keys.SHADOW_READY.format(sgen=self.shadow_set, rank=r)])
            for r, p in self.shadows.items())
        ready = all(self._node_sync("shadows_ready", ready))  # promote only if every node can
        for rank in self._local_ranks():
            self.store.set(keys.HEARTBEAT.format(rank=rank), "")
        self._heartbeats.clear()
        self.store.set(keys.SHADOWS_READY, "")
        if ready:
            self.store.set(keys.PROMOTE.format(sgen=self.shadow_set), json.dumps({"generation": self.generation}))
            for p in self.shadows.values():
                p.role, p.generation = "active", self.generation
            self.actives, self.shadows = self.shadows, {}
            self.events.emit("shadows_promoted", self.generation, shadow_set=self.shadow_set)
            return "shadow"
        self._kill(self.shadows)
        self.shadows = {}
        self._start_actives(resume="retained")
        self.events.emit("cold_start", self.generation, reason="no ready shadow set: new trainers attach to retained state")
        return "cold"

    def _wait_resumed(self, timing: dict, t_repaired: float) -> Failure | dict:
        from .agent import _stopped

        deadline = time.time() + self.config.startup_timeout
        pending = set(self.actives)
        infos = {}
        while pending:
            for r in list(pending):
                key = keys.RESUMED.format(gen=self.generation, rank=r)
                if self.store.check([key]):
                    infos[r] = json.loads(self.store.get(key))
                    pending.discard(r)
            failure = self._detect()
            if failure is not None:
                self.events.emit("recovery_failed", self.generation, rank=failure.rank, reason=failure.describe())
                return failure
            if time.time() > deadline:  # blame a stopped trainer, not the healthy one waiting for it
                p = min((self.actives[r] for r in pending), key=lambda p: (not _stopped(p.pid), p.rank))
                return self._failure(p, hang=True)
            self._stop.wait(self.config.poll_interval)
        last = max(infos.values(), key=lambda i: i["t"])  # the rank the job waited for
        timing["init"], timing["resume"] = last["init_s"], last["resume_s"]
        timing["start"] = max(0.0, last["t"] - t_repaired - last["init_s"] - last["resume_s"])
        return infos

    def _track_first_iteration(self) -> None:
        """Close a recovery's books when every rank finished an iteration after resuming."""
        rec = self.pending_recovery
        if rec is None:
            return
        done = [keys.FIRST_DONE.format(gen=self.generation, rank=r) for r in self.actives]
        if not self.store.check(done):
            return
        now = max(float(self.store.get(k)) for k in done)
        first = now - rec["t_resumed"]
        breakdown = {k: round(rec[k], 4) for k in BREAKDOWN}
        breakdown["recompute"] = round(first if rec["recomputes"] else 0.0, 4)
        breakdown["next_iteration"] = round(0.0 if rec["recomputes"] else first, 4)
        total = now - rec["t_fail"]  # failure -> first completed iteration: the sum of the breakdown
        self.events.emit("recovery_finished", self.generation, breakdown=breakdown,
                         first_iteration_s=round(first, 4), total_s=round(total, 4),
                         resume_iteration=rec["resume_iteration"], failed_iteration=rec["failed_iteration"],
                         promoted=rec["promoted"], repair=rec["repair"], shadow_level=rec["shadow_level"])
        if self._shadows_due:
            self._shadows_due = False
            self._start_shadows()
        print(f"[leto] recovered in place (generation {self.generation}): resumed at iteration "
              f"{rec['resume_iteration']}, {total:.2f} s to the first iteration after the failure {breakdown}",
              file=self.out, flush=True)
        self.pending_recovery = None

    def _restart_from_checkpoint(self, reason: str) -> Failure | None:
        """The slow path: everything restarts; the script resumes from its last checkpoint."""
        self.generation += 1
        self.events.emit("fallback_checkpoint", self.generation, reason=reason)
        print(f"[leto] restarting from the last checkpoint: {reason}", file=self.out, flush=True)
        self._kill(self.actives)
        self._kill(self.shadows)
        self.actives, self.shadows, self.pending_recovery = {}, {}, None
        unlink_segments(self.job_id)
        self.job_id = self._shared_job_id(new_job_id())
        self.all_job_ids.append(self.job_id)
        self._start_actives(resume="checkpoint")
        self._start_shadows()
        return None

    def _watch_shadows(self) -> None:
        """A shadow that died while waiting is replaced -- with its whole set, on every node:
        the set is one process group. The replacement counter in the store keeps nodes in step."""
        self._check_stop()  # shadows that died of the process group's SIGTERM are not replaced
        dead = [p for p in self.shadows.values() if p.poll() is not None]
        for p in dead:
            code, sig = p.exit_status()
            self.events.emit("shadow_failed", self.generation, rank=p.rank, pid=p.pid, exit_code=code, signal=sig,
                             shadow_set=p.shadow_set)
        key = keys.SHADOW_REPLACE.format(gen=self.generation)
        count = self.store.add(key, 1 if dead else 0)
        if count > self._replacements_seen:
            self._replacements_seen = count
            self._kill(self.shadows)
            self.shadows = {}
            self._start_shadows(replacement=count)
