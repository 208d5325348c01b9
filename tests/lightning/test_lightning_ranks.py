"""Two ranks on one node, started externally (as ``leto launch`` will start them): LetoStrategy
trains bit-identically to Lightning's DDP, and the node's tier-2 parity -- encoded across the
ranks' stores at setup, then kept current by deltas -- rebuilds a rank's lost pages."""

from __future__ import annotations

import torch

from leto_lightning.integrations.lightning import LetoStrategy
from leto_lightning.retained.store import RetainedStore
from leto_lightning.updater.recovery import recover_node

from pl_job import RunConfig, differences, fit, run_ranks


def test_two_ranks_match_ddp_and_tier2_rebuilds_a_rank(job: str) -> None:
    cfg = dict(devices=2, max_epochs=2)
    # seed=rank: the ranks build different weights; DDP's broadcast makes rank 0's everyone's
    plain = run_ranks(lambda rank: fit(RunConfig(strategy="ddp", seed=rank, **cfg)), world=2)
    leto = run_ranks(lambda rank: fit(RunConfig(strategy=LetoStrategy(job_id=job, page_bytes=512, tier2_parity=1),
                                                seed=rank, **cfg)), world=2)
    for rank in range(2):
        assert differences(leto[rank], plain[rank]) == [], f"rank {rank}"
    assert leto[0]["global_step"] == 6  # per epoch: 5 batches per rank, steps after 2, 4 and the last

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
