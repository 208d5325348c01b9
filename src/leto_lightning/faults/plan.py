"""Fault schedules: which trainer dies where and when, as a list of ``LETO_FAULTS`` entries.

``leto train`` and ``leto demo`` plan their hardware-operable failures here
(``faults.hof_every=N``, ``faults.hof_phase``); ``faults.injector`` fires them in the trainers.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

HOF_POINTS = {  # where a HOF of each phase strikes (injection points of faults.points)
    "compute": ("compute.begin",),
    "update": ("chunk.math_done", "chunk.tier1_partial"),
    "random": ("compute.begin", "chunk.math_done", "chunk.tier1_partial", "record.half_written"),
}


def hof_faults(hof_every: int, phase: str, max_steps: int, ranks: int, seed: int) -> list[dict]:
    """One SIGKILL every ``hof_every`` iterations, alternating ranks, at the chosen phase, each
    once a shadow set is ready (the steady state of a long job). ``hof_every=0``: none."""
    rng = random.Random(seed)
    points = list(HOF_POINTS[phase])
    faults = []
    for n, it in enumerate(range(hof_every, max_steps, hof_every) if hof_every else []):
        point = rng.choice(points)
        faults.append({"id": n, "rank": n % ranks, "iteration": it, "point": point, "occurrence": 1,
                       "wait_shadows": True})
    return faults


def planned_faults(plan: Iterable[tuple[Sequence[int], str, tuple[int, int], int]], seed: int) -> list[dict]:
    """SIGKILLs from a plan of ``(ranks, point, (first, last iteration), occurrences of the point
    per iteration)``: each entry strikes at a seeded iteration and occurrence, every rank it
    names at once, once a shadow set is ready (a long job's steady state)."""
    rng = random.Random(seed)
    faults: list[dict] = []
    for ranks, point, (lo, hi), most in plan:
        it, occurrence = rng.randint(lo, hi), rng.randint(1, most)
        for r in ranks:
            faults.append({"id": len(faults), "rank": r, "iteration": it, "point": point, "occurrence": occurrence,
                           "wait_shadows": True})
    return faults
