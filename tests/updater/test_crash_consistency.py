"""SIGKILL at random injection points of the update, recover in a fresh process, compare
with the fault-free run bit for bit (docs/design.md section 2.3; issue: 'Crash consistency, shown').

CI runs 120 seeded cases (reproducible: the seed names the case); ``LETO_LONG=1`` runs
thousands (``LETO_CRASH_CASES=N`` to choose).
"""

from __future__ import annotations

import os

import pytest
import torch

from leto_lightning.testing.scenario import OPTIMIZERS, CoreScenario

from .crash_cases import MAX_T, run_case, step_points

torch.set_num_threads(1)  # bit-identical needs the same thread count in every process

TOTAL = int(os.environ.get("LETO_CRASH_CASES", 4000 if os.environ.get("LETO_LONG") else 120))
PER_OPTIMIZER = -(-TOTAL // len(OPTIMIZERS))  # at least TOTAL cases in all


@pytest.fixture(scope="module")
def prepared():
    out = {}
    for name in OPTIMIZERS:
        sc = CoreScenario(optimizer=name)
        out[name] = (sc, sc.reference(MAX_T + 1), step_points(sc))
    return out


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_random_sigkill_points_recover_bit_identical(prepared, optimizer):
    scenario, reference, points = prepared[optimizer]
    names = {p.name for p in points}
    # every sub-step boundary is a candidate: undo copy, math, parity deltas, checksum, commit, record
    if optimizer.endswith("_whole"):
        expected = {"whole.undo_saved", "whole.math_done", "chunk.tier1_partial", "chunk.tier2_partial",
                    "whole.checksummed", "whole.committed"}
    else:
        expected = {"chunk.undo_copied", "chunk.math_done", "chunk.tier1_partial", "chunk.tier2_partial",
                    "chunk.checksummed", "chunk.committed"}
    assert expected | {"record.half_written", "prepare.recorded"} <= names
    failures, seen = [], set()
    for seed in range(PER_OPTIMIZER):
        result = run_case(scenario, reference, points, seed)
        seen.update(k.split("#")[0] for k in result.kills.values())
        if not result.ok:
            failures.append((seed, result))
    assert not failures, f"{len(failures)} of {PER_OPTIMIZER} cases not bit-identical; first: {failures[0]}"
    assert len(seen) >= min(len(names), PER_OPTIMIZER // 4), f"kill points too narrow: {sorted(seen)}"
