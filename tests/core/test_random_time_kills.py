"""SIGKILL inside ``RetainedOptimizer.step()`` at uniformly random *times* (not at the named
injection points), calibrated to the measured step duration; recover in a fresh process and
compare with plain ``torch.optim`` (``torch.equal``) at the reported resume point.

SGD, Adam(amsgrad), AdamW and a whole-state optimizer (RMSprop), on 1 and 2 ranks. CI runs 104
seeded cases; ``LETO_LONG=1`` runs 3,200 (``LETO_TIME_KILL_CASES=N`` to choose).
"""

from __future__ import annotations

import os
import random
import statistics
import time

import pytest
import torch

from leto_lightning.testing.crash import KillAfter, KillPoint, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences

from .crash_cases import _prepared, _recover_and_continue, _shadow_step

torch.set_num_threads(1)
CONFIGS = [(opt, ranks) for opt in ("sgd_nesterov", "adam_amsgrad", "adamw", "rmsprop_whole") for ranks in (1, 2)]
TOTAL = int(os.environ.get("LETO_TIME_KILL_CASES", 3200 if os.environ.get("LETO_LONG") else 104))
PER_CONFIG = -(-TOTAL // len(CONFIGS))
PART = 60  # cases per test item: each item stays well inside the suite's per-test timeout
PARTS = [(opt, ranks, part) for opt, ranks in CONFIGS for part in range(-(-PER_CONFIG // PART))]
MAX_T = 2  # kill in iteration 0 or 1 (a first step, and one with optimizer state)


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


def run_time_case(scenario: CoreScenario, reference, duration: float, seed: int) -> tuple[bool, bool, str]:
    """(bit-identical at the right resume point, some rank was really killed, details)."""
    rng = random.Random(seed)
    job = scenario.create_job()
    try:
        t = rng.randrange(MAX_T)
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


@pytest.mark.parametrize("optimizer,ranks,part", PARTS)
def test_kills_at_random_times_recover_bit_identical(optimizer, ranks, part):
    scenario = CoreScenario(optimizer=optimizer, n_ranks=ranks)
    reference = scenario.reference(MAX_T + 1)
    duration = step_seconds(scenario)
    failures, killed = [], 0
    seeds = range(part * PART, min(PER_CONFIG, (part + 1) * PART))
    for seed in seeds:
        ok, was_killed, detail = run_time_case(scenario, reference, duration, seed)
        killed += was_killed
        if not ok:
            failures.append(detail)
    assert killed >= len(seeds) // 4, f"only {killed} of {len(seeds)} cases killed a rank before its step ended"
    assert not failures, f"{len(failures)} of {len(seeds)} cases not bit-identical; first: {failures[:2]}"
