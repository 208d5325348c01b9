"""One crash case: kill rank(s) at chosen points of iteration t, recover in a fresh process,
train one more iteration, and compare with the fault-free reference."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from leto_lightning.faults.points import set_hook
from leto_lightning.retained.record import RecordStatus
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillAfter, KillPoint, PointRecorder, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences, run_step, snapshot
from leto_lightning.updater.recovery import recover_node

MAX_T = 3  # kill in iteration 0..MAX_T-1; the reference runs MAX_T + 1 iterations


def step_points(scenario: CoreScenario) -> list[KillPoint]:
    """Every injection point one rank passes in one iteration (a dry run)."""
    job = scenario.create_job()
    recorder = PointRecorder()
    previous = set_hook(recorder)
    try:
        job.step(0, 0)
    finally:
        set_hook(previous)
        job.close()
    return recorder.points


@dataclass
class CaseResult:
    iteration: int
    kills: dict
    resume_iteration: int
    expected_resume: int
    diffs: dict
    reports: list

    @property
    def ok(self) -> bool:
        return self.resume_iteration == self.expected_resume and not any(self.diffs.values())


def run_case(scenario: CoreScenario, reference, points: list[KillPoint], seed: int) -> CaseResult:
    rng = random.Random(seed)
    job = scenario.create_job()
    try:
        t = rng.randrange(MAX_T)
        job.run(t)
        ranks = list(range(scenario.n_ranks))
        victims = rng.choice([[r] for r in ranks] + [ranks])
        kills = {r: rng.choice(points) for r in victims}
        barrier = points.index(KillPoint("prepare.barrier"))
        recorded = points.index(KillPoint("prepare.recorded"))
        # A rank cannot get past the prepare barrier while a peer dies before preparing: such a
        # kill point becomes the barrier itself. (Running the victims one after the other is a
        # valid interleaving: each touches its own store, and tier-2 deltas commute.)
        for r in victims:
            never = [q for q in victims if q != r and points.index(kills[q]) < recorded]
            if points.index(kills[r]) > barrier and never:
                kills[r] = points[barrier]
        for r in victims:
            res = run_in_child(lambda r=r: _shadow_step(job, r, t), kill_at=kills[r])
            assert res.killed, f"rank {r} never reached {kills[r]}"
        all_prepared = all(_prepared(job, r, t) for r in victims)
        for r in ranks:
            if r not in victims:  # survivors: finish, or block at the barrier and get killed there
                kill = None if all_prepared else KillPoint("prepare.barrier")
                run_in_child(lambda r=r: _shadow_step(job, r, t), kill_at=kill)
        # A rollback window keeps t only once every rank sealed it; otherwise t is redone.
        kept = all(_sealed(job, r, t) for r in ranks) if scenario.rollback else all_prepared
        result = run_in_child(lambda: _recover_and_continue(job, t + 1))
        resume, states, reports = result.value
        diffs = {r: differences(states[r], reference[r][t + 2]) for r in ranks}
        return CaseResult(t, {r: str(k) for r, k in kills.items()}, resume, t + 1 if kept else t, diffs, reports)
    finally:
        job.close()


def _prepared(job, rank: int, t: int) -> bool:
    entry = job.stores[rank].record.read()
    reached = (RecordStatus.PREPARED, RecordStatus.COMMITTED)
    return entry is not None and entry.progress.status in reached and entry.progress.iteration == t


def _sealed(job, rank: int, t: int) -> bool:
    entry = job.stores[rank].record.read()
    rec = entry.progress if entry is not None else None
    return rec is not None and rec.status == RecordStatus.COMMITTED and rec.iteration == t and not rec.open


def _shadow_step(job, rank: int, t: int) -> None:
    model, ro = job.attach_trainer(rank)
    run_step(job.scenario, model, ro, rank, t)


def _recover_and_continue(job, until: int):
    """In a fresh process: recover every rank, then train through iteration ``until``."""
    stores = {r: RetainedStore.attach(job.job_id, r) for r in range(job.scenario.n_ranks)}
    reports = recover_node(stores)
    resume = {rep.resume_iteration for rep in reports.values()}
    assert len(resume) == 1, f"ranks disagree on the resume point: {resume}"
    states = {}
    for r in stores:
        model, ro = job.attach_trainer(r)
        for it in range(ro.iteration, until + 1):
            run_step(job.scenario, model, ro, r, it)
        states[r] = snapshot(model, ro.optimizer)
    return resume.pop(), states, [rep.summary() for rep in reports.values()]


def step_seconds(scenario: CoreScenario) -> float:
    """Median duration of ``step()`` (prepare to commit) on this machine, now."""
    job = scenario.create_job()
    try:
        model, ro = job.trainers[0]
        times = []
        for it in range(5):
            ro.zero_grad()
            scenario.compute(model, 0, it)
            t0 = time.perf_counter()
            ro.step()
            times.append(time.perf_counter() - t0)
            for r in range(1, scenario.n_ranks):
                job.step(r, it)
        return statistics.median(times)
    finally:
        job.close()


def run_time_case(scenario: CoreScenario, reference, duration: float, seed: int,
                  max_t: int) -> tuple[bool, bool, str]:
    """(bit-identical at the right resume point, some rank was really killed, details); the kill
    falls in iteration 0..max_t-1."""
    rng = random.Random(seed)
    job = scenario.create_job()
    try:
        t = rng.randrange(max_t)
        job.run(t)
        ranks = list(range(scenario.n_ranks))
        victims = rng.choice([[r] for r in ranks] + ([ranks] if len(ranks) > 1 else []))
        kills = {}
        for r in victims:
            # The prepare barrier: no rank passes it unless every rank prepared. So after an earlier
            # victim that died unprepared, this one dies at the barrier; after one that prepared
            # (and may have passed it), this one's random time counts from the barrier.
            if any(not _prepared(job, q, t) for q in kills):
                kill = KillPoint("prepare.barrier")
            else:
                kill = KillAfter("prepare.barrier" if kills else "prepare.begin", rng.uniform(0.0, 1.1 * duration))
            res = run_in_child(lambda r=r: _shadow_step(job, r, t), kill_at=kill)
            kills[r] = f"{kill}{'' if res.killed else ' (finished first)'}"
        all_prepared = all(_prepared(job, r, t) for r in ranks if r in victims)
        for r in ranks:
            if r not in victims:
                run_in_child(lambda r=r: _shadow_step(job, r, t),
                             kill_at=None if all_prepared else KillPoint("prepare.barrier"))
        all_prepared = all(_prepared(job, r, t) for r in ranks)
        resume, states, reports = run_in_child(lambda: _recover_and_continue(job, t + 1)).value
        diffs = {r: differences(states[r], reference[r][t + 2]) for r in ranks}
        expected = t + 1 if all_prepared else t
        ok = resume == expected and not any(diffs.values())
        killed = any("finished first" not in k for k in kills.values())
        return ok, killed, (f"seed {seed}: t={t} kills={kills} resume={resume} (expected {expected}) "
                            f"diffs={diffs} {reports}")
    finally:
        job.close()
