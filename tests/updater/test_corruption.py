"""Damage to retained pages: repaired bit-exactly within the parity's reach, reported beyond it."""

from __future__ import annotations

import random

import pytest
import torch

from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.scenario import CoreScenario, differences, snapshot
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.repair import UnrecoverableDamageError

torch.set_num_threads(1)
STEPS = 2


@pytest.fixture
def trained():
    """A 2-device job after STEPS iterations, and the fault-free reference state."""
    sc = CoreScenario()
    ref = sc.reference(STEPS)
    job = sc.create_job()
    job.run(STEPS)
    yield sc, job, ref
    job.close()


def _poison(store: RetainedStore, page: int, rng: random.Random) -> None:
    """Overwrite a page with random bytes (a poisoned / torn page)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    store.pages[page].copy_(torch.randint(0, 256, (store.layout.page_bytes,), dtype=torch.uint8, generator=g))


def _state_equal(job, ref):
    return {r: differences(job.state(r), ref[r][STEPS]) for r in range(job.scenario.n_ranks)}


def _stores(job):
    return {r: job.stores[r] for r in range(job.scenario.n_ranks)}


@pytest.mark.parametrize("seed", range(6))
def test_up_to_h1_pages_per_group_are_repaired_by_tier1(trained, seed):
    sc, job, ref = trained
    rng = random.Random(seed)
    store = job.stores[rng.randrange(sc.n_ranks)]
    plan = store.spec.tier1
    victims = []
    for _g, pages in enumerate(plan.groups):
        if store.layout.page_kind[pages[0]] == "grad":
            continue
        victims += rng.sample(pages, min(len(pages), rng.randint(0, sc.config.tier1_parity)))
    for p in victims:
        _poison(store, p, rng)
    reports = recover_node(_stores(job))
    repaired = reports[0].repair
    assert sorted(repaired.tier1.get(store.spec.local_rank, [])) == sorted(victims)
    assert not any(_state_equal(job, ref).values())


def test_whole_device_lost_is_rebuilt_by_tier2(trained):
    _sc, job, ref = trained
    lost = job.stores[1]
    kinds = lost.layout.page_kind
    lost.pages.fill_(0xA5)  # the device's retained memory is gone (reset / state manager died)
    reports = recover_node(_stores(job))
    rebuilt = reports[1].repair.tier2.get(1, [])
    assert sorted(rebuilt) == [p for p in range(lost.layout.n_pages) if kinds[p] != "grad"]
    assert not any(_state_equal(job, ref).values())


def test_one_page_more_than_parity_covers_is_reported(trained):
    sc, job, _ref = trained
    rng = random.Random(7)
    store = job.stores[0]
    plan = store.spec.tier1
    group = next(g for g, pages in enumerate(plan.groups) if len(pages) > sc.config.tier1_parity
                 and store.layout.page_kind[pages[0]] != "grad")
    pages = plan.groups[group][: sc.config.tier1_parity + 1]
    for p in pages:
        _poison(store, p, rng)
        _poison(job.stores[1], p, rng)  # the same stripe on the other device: tier 2 cannot help either
    with pytest.raises(UnrecoverableDamageError) as err:
        recover_node(_stores(job))
    message = str(err.value)
    assert "checkpoint" in message and f"Tier-1 group {group}" in message
    assert set(err.value.lost[0]) == set(pages)


def test_crash_plus_poisoned_page_in_another_group(trained):
    """A torn chunk and an unrelated poisoned page in one recovery: both fixed."""
    from leto_lightning.testing.crash import KillPoint, run_in_child

    from .crash_cases import _shadow_step

    sc, job, _ref = trained
    res = run_in_child(lambda: _shadow_step(job, 0, STEPS), kill_at=KillPoint("chunk.math_done", 3))
    assert res.killed
    run_in_child(lambda: _shadow_step(job, 1, STEPS))
    store = job.stores[0]
    far_page = store.layout.n_pages - 1 - store.layout.regions[-1].n_pages  # not in chunk 2
    _poison(store, far_page, random.Random(3))
    reports = recover_node(_stores(job))
    assert reports[0].restored and reports[0].repair.tier1.get(0) == [far_page]
    for r in range(sc.n_ranks):
        model, ro = job.attach_trainer(r)
        assert ro.iteration == STEPS + 1
        expected = CoreScenario().reference(STEPS + 1)[r][STEPS + 1]
        assert not differences(snapshot(model, ro.optimizer), expected)
