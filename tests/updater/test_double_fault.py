"""A second fault during recovery: the recovery process is SIGKILLed at a random point (between
undo-restore, repair, parity verification and roll-forward, or inside them), recovery runs
again, and then one page is lost in every group the torn chunk touched: it must be repaired
exactly (the first recovery's half-written parity must not survive the second)."""

from __future__ import annotations

import random

import torch

from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences, snapshot
from leto_lightning.updater.recovery import recover_node

from .crash_cases import _shadow_step
from .test_corruption import _poison

torch.set_num_threads(1)
CASES = 16
RECOVERY_POINTS = ["recovery.undo_partial", "recovery.restored", "recovery.repaired", "recovery.parity_partial",
                   "recovery.parity_verified", "chunk.undo_copied", "chunk.math_done", "chunk.tier1_partial",
                   "chunk.tier2_partial", "chunk.checksummed", "chunk.committed", "record.half_written"]
TORN_POINTS = ["chunk.math_done", "chunk.tier1_partial", "chunk.tier2_partial", "chunk.checksummed"]


def _recover(job_id: str, n_ranks: int):
    stores = {r: RetainedStore.attach(job_id, r) for r in range(n_ranks)}
    try:
        return recover_node(stores)
    finally:
        for s in stores.values():
            s.close()


def test_recovery_killed_then_recovered_again_keeps_parity_consistent():
    sc = CoreScenario()
    reference = sc.reference(3)
    killed_at = set()
    for seed in range(CASES):
        rng = random.Random(seed)
        job = sc.create_job()
        try:
            for r in range(sc.n_ranks):
                job.step(r, 0)
            torn = KillPoint(rng.choice(TORN_POINTS), rng.randint(1, 6))
            assert run_in_child(lambda: _shadow_step(job, 0, 1), kill_at=torn).killed
            run_in_child(lambda: _shadow_step(job, 1, 1))
            chunk = next(c for c in range(job.stores[0].layout.n_chunks) if int(job.stores[0].versions()[c]) == 1
                         or int(job.stores[0].chunk_table[c, 1]) != 0)
            second = KillPoint(rng.choice(RECOVERY_POINTS), rng.randint(1, 2))
            res = run_in_child(lambda: _recover(job.job_id, sc.n_ranks), kill_at=second)
            if res.killed:
                killed_at.add(second.name)
            _recover(job.job_id, sc.n_ranks)  # the recovery after the second fault
            # parity is consistent now: nothing left to rewrite, and one lost page per touched group is repaired
            store = job.stores[0]
            plan = store.spec.tier1
            groups = plan.groups_of(store.layout.chunk_pages_updated(chunk))
            lost = [rng.choice(plan.groups[g]) for g in groups]
            for page in lost:
                _poison(store, page, rng)
            reports = _recover(job.job_id, sc.n_ranks)
            assert reports[0].reencoded_tier1 == [] and reports[0].reencoded_tier2 == [], (seed, second, reports[0])
            rebuilt = sorted(reports[0].repair.tier1.get(0, []))
            assert rebuilt == sorted(lost), (seed, torn, second, reports[0].summary())
            for r in range(sc.n_ranks):
                model, ro = job.attach_trainer(r)
                assert ro.iteration == 2, (seed, second)
                assert not differences(snapshot(model, ro.optimizer), reference[r][2]), (seed, torn, second)
                ro.store.close()
        finally:
            job.close()
    assert len(killed_at) >= 5, f"the second fault hit too few places: {sorted(killed_at)}"
