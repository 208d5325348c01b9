"""Two ranks on one node, started externally (as ``leto launch`` will start them).

- LetoStrategy trains bit-identically to Lightning's DDP, and the node's tier-2 parity --
  encoded across the ranks' stores at setup, then kept current by deltas -- rebuilds a rank
  whose retained pages are all lost.
- One rank SIGKILLed mid-update (its peer fails in the next collective), node recovery
  (``recover_node`` on both stores: the killed rank rolls forward), both ranks resumed in new
  processes with ``ckpt_path="leto://retained"``: bit-identical to an uninterrupted DDP run.

The agent, shadows and re-entry without new processes are the runtime's part (docs/lightning.md).
"""

from __future__ import annotations

import pytest
import torch
from pl_job import RunConfig, differences, fit, run_ranks

from leto_lightning.integrations.lightning import RETAINED_CKPT, LetoStrategy
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint
from leto_lightning.updater.recovery import recover_node

CFG = dict(devices=2, max_epochs=2)  # per epoch: 5 batches per rank, steps after 2, 4 and the last
CHUNKS = 7


def _leto(job: str, **kwargs: object) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, tier2_parity=1, **kwargs)


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    # seed=rank: the ranks build different weights; DDP's broadcast makes rank 0's everyone's
    return run_ranks(lambda rank: fit(RunConfig(strategy="ddp", seed=rank, **CFG)), world=2)


def test_two_ranks_match_ddp_and_tier2_rebuilds_a_rank(ddp: list[dict], job: str) -> None:
    # keep_retained: a completed fit frees its store; this test rebuilds a rank from it afterwards
    leto = run_ranks(lambda rank: fit(RunConfig(strategy=_leto(job, keep_retained=True), seed=rank, **CFG)), world=2)
    for rank in range(2):
        assert differences(leto[rank], ddp[rank]) == [], f"rank {rank}"
    assert leto[0]["global_step"] == 6

    stores = {r: RetainedStore.attach(job, r) for r in range(2)}
    try:
        lost = stores[1].pages.clone()
        stores[1].pages.zero_()  # rank 1's whole retained state is gone; tier 1 cannot cover that
        reports = recover_node(stores)
        assert reports[1].repair is not None and reports[1].repair.repaired > 0
        kept = list(stores[1].layout.update_pages)  # params and optimizer state (a committed
        assert torch.equal(stores[1].pages[kept], lost[kept])  # step's gradients are not needed)
    finally:
        for s in stores.values():
            s.close()


def test_one_rank_killed_both_resume_bit_identical(ddp: list[dict], job: str) -> None:
    crashed = run_ranks(lambda rank: fit(RunConfig(strategy=_leto(job), seed=rank, **CFG)), world=2,
                        kill=(1, KillPoint("chunk.math_done", 3 * CHUNKS + 4)), allow_failure=True, timeout=60)
    assert crashed == [None, None]  # rank 1 killed, rank 0 failed in its next collective

    stores = {r: RetainedStore.attach(job, r) for r in range(2)}
    try:
        reports = recover_node(stores)  # what the agent will do
    finally:
        for s in stores.values():
            s.close()
    assert [reports[r].resume_iteration for r in range(2)] == [4, 4]
    assert reports[1].rolled_forward  # rank 1 died mid-update; rank 0 had committed
    resumed = run_ranks(lambda rank: fit(RunConfig(strategy=_leto(job), seed=rank + 10, ckpt_path=RETAINED_CKPT,
                                                   **CFG)), world=2)
    for rank in range(2):
        assert differences(resumed[rank], ddp[rank]) == [], f"rank {rank}"
