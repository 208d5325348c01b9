"""Random damage in every segment kind (data, parity, undo, meta, spec, record), from one
location up to parity + 2: every case ends exactly repaired or with the documented error
(a ``RetainedStateError``), never silently wrong (issue: "every byte that recovery trusts is
checked"). CI runs 252 seeded cases; ``LETO_LONG=1`` runs 1,800 (``LETO_DAMAGE_CASES=N`` to
choose). The counts by segment kind and outcome are printed at the end."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from leto_lightning.testing.scenario import CoreScenario

from .damage_cases import KINDS, make_base, run_damage_case, run_repeated_damage_case, table

torch.set_num_threads(1)
BASES = [(optimizer, name) for optimizer in ("adamw", "rmsprop_whole") for name in ("idle", "torn")]
ALL_KINDS = KINDS + ("mix",)
ITEMS = [(b, k) for b in range(len(BASES)) for k in ALL_KINDS]
TOTAL = int(os.environ.get("LETO_DAMAGE_CASES", 1800 if os.environ.get("LETO_LONG") else 240))
PER_ITEM = -(-TOTAL // len(ITEMS))
STEPS = 2
COUNTS: Counter = Counter()  # (kind or base, outcome) over every case of this module


@pytest.fixture(scope="module")
def bases():
    """A chunked (AdamW) and a whole-state (RMSprop) job, each idle between iterations and torn
    in the middle of an update."""
    out, references = [], {}
    for optimizer, name in BASES:
        sc = CoreScenario(optimizer=optimizer)
        if optimizer not in references:
            references[optimizer] = sc.reference(STEPS + 3)
        out.append(make_base(sc, references[optimizer], name, STEPS))
    yield out
    for base in out:
        base.job.close()


@pytest.mark.parametrize("base_index,kind", ITEMS)
def test_random_damage_is_repaired_exactly_or_reported(bases, base_index, kind):
    base, failures = bases[base_index], []
    item = ITEMS.index((base_index, kind))
    for j in range(PER_ITEM):
        seed = item + len(ITEMS) * j
        outcome, detail = run_damage_case(base, kind, seed)
        COUNTS[(kind, outcome)] += 1
        COUNTS[("all: " + base.name, outcome)] += 1
        if outcome not in ("exact", "reported"):
            failures.append((seed, outcome, detail))
    assert not failures, f"{len(failures)} of {PER_ITEM} {base.name}/{kind} cases wrong; first: {failures[:3]}"


@pytest.mark.parametrize("kinds", [("spec",), ("meta", "record")])
@pytest.mark.parametrize("base_index", [i for i, (_, name) in enumerate(BASES) if name == "idle"])
def test_damage_to_one_copy_then_another_is_repaired_both_times(bases, base_index, kinds):
    """Two rounds of one damaged location each in the kinds kept twice (spec and completion mark;
    metadata and its mirror, undo header, progress record), recovered after each: all exact."""
    failures = []
    for seed in range(PER_ITEM * 4):
        outcome, detail = run_repeated_damage_case(bases[base_index], kinds, seed)
        if outcome != "exact":
            failures.append((seed, outcome, detail))
    assert not failures, f"{len(failures)} of {PER_ITEM * 4} cases lost; first: {failures[:3]}"


def test_damage_counts_by_kind_and_outcome(capsys):
    """The table over every case above; damage the redundancy covers must really be repaired."""
    if not COUNTS:
        pytest.skip("run with the damage cases above")
    n = sum(v for (k, _), v in COUNTS.items() if not k.startswith("all: "))
    with capsys.disabled():
        print(f"\ndamage cases by segment kind and outcome ({n} cases):\n{table(COUNTS)}")
    assert not any(o not in ("exact", "reported") for _, o in COUNTS)
    for kind in KINDS:
        assert COUNTS[(kind, "exact")] > 0, f"no {kind} damage was ever repaired:\n{table(COUNTS)}"
