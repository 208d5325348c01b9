"""SIGKILL inside ``RetainedOptimizer.step()`` at uniformly random *times* (not at the named
injection points), calibrated to the measured step duration; recover in a fresh process and
compare with plain ``torch.optim`` (``torch.equal``) at the reported resume point.

SGD, Adam(amsgrad), AdamW and a whole-state optimizer (RMSprop), on 1 and 2 ranks. CI runs 104
seeded cases; ``LETO_LONG=1`` runs 3,200 (``LETO_TIME_KILL_CASES=N`` to choose).
"""

from __future__ import annotations

import os

import pytest
import torch

from leto_lightning.testing.scenario import CoreScenario

from .crash_cases import run_time_case, step_seconds

torch.set_num_threads(1)
CONFIGS = [(opt, ranks) for opt in ("sgd_nesterov", "adam_amsgrad", "adamw", "rmsprop_whole") for ranks in (1, 2)]
TOTAL = int(os.environ.get("LETO_TIME_KILL_CASES", 3200 if os.environ.get("LETO_LONG") else 104))
PER_CONFIG = -(-TOTAL // len(CONFIGS))
PART = 60  # cases per test item: each item stays well inside the suite's per-test timeout
PARTS = [(opt, ranks, part) for opt, ranks in CONFIGS for part in range(-(-PER_CONFIG // PART))]
MAX_T = 2  # kill in iteration 0 or 1 (a first step, and one with optimizer state)


@pytest.mark.parametrize("optimizer,ranks,part", PARTS)
def test_kills_at_random_times_recover_bit_identical(optimizer, ranks, part):
    scenario = CoreScenario(optimizer=optimizer, n_ranks=ranks)
    reference = scenario.reference(MAX_T + 1)
    duration = step_seconds(scenario)
    failures, killed = [], 0
    seeds = range(part * PART, min(PER_CONFIG, (part + 1) * PART))
    for seed in seeds:
        ok, was_killed, detail = run_time_case(scenario, reference, duration, seed, MAX_T)
        killed += was_killed
        if not ok:
            failures.append(detail)
    assert killed >= len(seeds) // 4, f"only {killed} of {len(seeds)} cases killed a rank before its step ended"
    assert not failures, f"{len(failures)} of {len(seeds)} cases not bit-identical; first: {failures[:2]}"
