"""Detection: one poll of every active trainer -- exited, hung, finished, or failed on another node.

A trainer failed when it exited non-zero before saying it finished training, or when its
heartbeat did not change within ``--heartbeat-timeout`` (``--startup-timeout`` before its
first). Survivors block in collectives soon after the culprit stops, so among hung trainers a
stopped process (state T) is blamed first, then the one whose own last heartbeat is oldest.
"""

from __future__ import annotations

import signal
import time

from .classify import FailedRole, Failure, node_lost_failure, printed_exception, stops_the_job
from .config import RuntimeConfig
from .control import SignedStore
from .coordination import JobIdentity, StopFlag
from .keys import EXCEPTION, FAILURE, FINISHED, HEARTBEAT
from .membership import Membership
from .messages import Heartbeat, Verdict
from .procs import TrainerProcess
from .spec import LaunchSpec
from .trainers import Trainers, stopped

STOP_GRACE_S = 1.0  # how long a trainer's SIGTERM/SIGINT death waits for the launcher's own signal


class Detector:
    def __init__(self, spec: LaunchSpec, config: RuntimeConfig, store: SignedStore, job: JobIdentity,
                 trainers: Trainers, stop: StopFlag) -> None:
        self.spec, self.config, self.store, self.job = spec, config, store, job
        self.trainers, self.stop = trainers, stop
        self.last_poll = time.time()  # the last poll that saw nothing wrong
        self.membership: Membership | None = None  # a job with spares: whole nodes are watched too

    def finished(self) -> int | None:
        """0 once every active trainer exited 0 or said it completed training, else None."""
        actives = self.trainers.actives
        codes = [p.poll() for p in actives.values()]
        if codes and all(c == 0 or (c is not None and self.completed(p)) for c, p in zip(codes, actives.values())):
            return 0
        return None

    def completed(self, p: TrainerProcess) -> bool:
        """The trainer said it finished training (whatever its exit status after that)."""
        return self.store.check([FINISHED.format(gen=p.generation, rank=p.rank)])

    def detect(self) -> Failure | None:
        """One poll of every active trainer. ``last_poll`` is the last poll that saw nothing
        wrong: a failure happened after it (the recovery breakdown's ``detect`` starts there)."""
        self.stop.check()
        now = time.time()
        failure = self._find_failure(now)
        if failure is None:
            self.last_poll = now
        elif _stop_signal_death(failure):
            self._await_stop_request()
        return failure

    def _find_failure(self, now: float) -> Failure | None:
        remote = self._remote_failure()
        if remote is not None:
            return remote
        actives = self.trainers.actives
        exited = []
        for p in actives.values():
            if p.poll() not in (None, 0) and not self.completed(p):
                exit_code, sig = p.exit_status()
                exited.append(self.failure(p, exit_code=exit_code, signal=sig))
        if exited:  # its peers die of it in their collectives: blame the likeliest cause (a failure no
            # restart fixes, then a signal death rather than a peer's "connection closed"), else the first rank
            return min(exited, key=lambda f: (not stops_the_job(f, self.config), f.signal is None))
        lost = self.membership.lost() if self.membership is not None else []
        if lost:  # its trainers' peers here block in collectives: the node is the cause, not them
            return node_lost_failure(lost, self.spec, "its agent stopped beating")
        hung = [p for p in actives.values() if p.poll() is None and self._hung(p, now)]
        if hung:
            p = min(hung, key=lambda p: (not stopped(p.pid), self._beat_time(p.rank)))
            return self.failure(p, hang=True, waiting_since=self.trainers.heartbeats[p.rank][1])
        return None

    def _await_stop_request(self) -> None:
        """A trainer died of SIGTERM/SIGINT: a scheduler (``timeout``, SLURM) signals the whole
        process group, and the launcher's own signal may land a moment later. A stop request
        within the grace period makes it a shutdown, not a failure to recover."""
        self.stop.wait(STOP_GRACE_S)
        self.stop.check()

    def _beat_time(self, rank: int) -> float:
        hb = self.last_heartbeat(rank)
        return hb.t if hb is not None else self.trainers.heartbeats[rank][1]

    def failure(self, p: TrainerProcess, hang: bool = False, exit_code: int | None = None,
                signal: int | None = None, waiting_since: float | None = None) -> Failure:
        """What is known about trainer ``p``'s failure: its last heartbeat, its exception (as it
        reported it, else the last line of a traceback it printed: it died before it could
        report, e.g. in its imports). A hang: ``waiting_since`` is when the agent began waiting
        for this trainer's heartbeat (it hangs since its last heartbeat, if any, else since then)."""
        hb = self.last_heartbeat(p.rank)
        key = EXCEPTION.format(pid=p.pid)
        said = self.store.read(key)
        exc = said.decode(errors="replace") if said is not None else None
        if exc is None and exit_code is not None:
            exc = printed_exception(p.last_line())
        hung_since = (hb.t if hb else waiting_since) if hang else None
        return Failure(rank=p.rank, pid=p.pid, role=FailedRole(p.role.value), exception=exc, detected_at=time.time(),
                       iteration=hb.it if hb else None, phase=hb.phase if hb else None,
                       last_heartbeat=hb.t if hb else None, hang=hang, exit_code=exit_code, signal=signal,
                       hung_since=hung_since)

    def _remote_failure(self) -> Failure | None:
        """Another node's agent declared a failure of this generation: recover in lockstep."""
        if self.spec.nnodes == 1:
            return None
        key = FAILURE.format(gen=self.job.generation)
        published = self.store.read(key)
        if published is None:
            return None
        verdict = Verdict.from_json(published)
        if verdict.node == self.spec.node_rank:
            return None
        return Failure(rank=verdict.rank, pid=None, role=FailedRole.REMOTE, detected_at=time.time(),
                       exception=f"on node {verdict.node}: {verdict.reason}", remote_verdict=verdict)

    def last_heartbeat(self, rank: int) -> Heartbeat | None:
        return Heartbeat.from_json(self._heartbeat(rank))

    def _heartbeat(self, rank: int) -> bytes:
        """The rank's heartbeat value; a deleted key counts as no new beat (the hang timer runs)
        and is put on record."""
        raw = self.store.read(HEARTBEAT.format(rank=rank))
        if raw is None:
            self.trainers.control_key_missing(HEARTBEAT.format(rank=rank))
            seen = self.trainers.heartbeats.get(rank)
            return seen[0] if seen is not None else b""
        return raw

    def _hung(self, p: TrainerProcess, now: float) -> bool:
        raw = self._heartbeat(p.rank)
        seen = self.trainers.heartbeats.get(p.rank)
        if seen is None or seen[0] != raw:
            self.trainers.heartbeats[p.rank] = (raw, now)
            return False
        limit = self.config.heartbeat_timeout if raw else self.config.startup_timeout
        return now - seen[1] > limit


def _stop_signal_death(failure: Failure) -> bool:
    """The trainer ended by SIGTERM/SIGINT (killed by it, its shell-style exit code, or Python's
    KeyboardInterrupt) -- what a stop request to the whole process group does to it."""
    stop = (signal.SIGTERM, signal.SIGINT)
    return (failure.signal in stop or failure.exit_code in tuple(128 + s for s in stop)
            or "KeyboardInterrupt" in (failure.exception or ""))
