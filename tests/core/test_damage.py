"""Random damage in every segment kind (data, parity, undo, meta, spec, record), from one
location up to parity + 2: every case ends exactly repaired or with the documented error
(a ``RetainedStateError``), never silently wrong (issue: "every byte that recovery trusts is
checked"). CI runs a few hundred seeded cases; ``LETO_LONG=1`` runs 1,800
(``LETO_DAMAGE_CASES=N`` to choose). The counts by segment kind and outcome are printed."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from leto_lightning.faults.scenario import CoreScenario

from .damage_cases import KINDS, make_base, run_damage_case, table

torch.set_num_threads(1)
TOTAL = int(os.environ.get("LETO_DAMAGE_CASES", 1800 if os.environ.get("LETO_LONG") else 240))
STEPS = 2


@pytest.fixture(scope="module")
def bases():
    """A chunked (AdamW) and a whole-state (RMSprop) job, each idle between iterations and torn
    in the middle of an update."""
    out = []
    for optimizer in ("adamw", "rmsprop_whole"):
        sc = CoreScenario(optimizer=optimizer)
        reference = sc.reference(STEPS + 3)
        out += [make_base(sc, reference, name, STEPS) for name in ("idle", "torn")]
    yield out
    for base in out:
        base.job.close()


def test_random_damage_is_repaired_exactly_or_reported(bases, capsys):
    counts, failures = Counter(), []
    kinds = KINDS + ("mix",)
    for seed in range(TOTAL):
        base, kind = bases[seed % len(bases)], kinds[(seed // len(bases)) % len(kinds)]
        outcome, detail = run_damage_case(base, kind, seed)
        counts[(kind, outcome)] += 1
        counts[("all: " + base.name, outcome)] += 1
        if outcome not in ("exact", "reported"):
            failures.append((seed, base.name, kind, outcome, detail))
    with capsys.disabled():
        print(f"\ndamage cases by segment kind and outcome ({TOTAL} cases):\n{table(counts)}")
    assert not failures, f"{len(failures)} of {TOTAL} cases wrong; first: {failures[:3]}"
    # the damage must actually be repaired where the redundancy covers it, not just reported
    for kind in KINDS:
        assert counts[(kind, "reported")] + counts[(kind, "exact")] > 0
        assert counts[(kind, "exact")] > 0, f"no {kind} damage was ever repaired: {table(counts)}"
