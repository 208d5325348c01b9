"""The core on two data-parallel ranks of one node: each rank's store, tier-2 parity across the
two, the prepare barrier, and recovery of both stores together after both trainers died.

    python examples/core_multi_rank.py

Ranks are forked processes joined by a gloo process group on loopback (what `leto launch`
does for you; docs/runtime.md).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from leto_lightning import (
    ParityCodes,
    RetainedConfig,
    RetainedOptimizer,
    RetainedStore,
    encode_tier2,
    new_job_id,
    recover_node,
    unlink_segments,
)
from leto_lightning.faults import set_hook

WORLD = 2
CONFIG = RetainedConfig(page_bytes=4096, data_pages=4, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank starts from the same weights (data parallel)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, ro: RetainedOptimizer, first: int, last: int) -> None:
    for i in range(first, last):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        ro.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)  # the retained gradients, reduced in place
                p.grad /= WORLD
        ro.step()


def barrier() -> None:
    """The prepare agreement: no rank commits a chunk of iteration t before all prepared t."""
    dist.all_reduce(torch.ones(1))


def rank_main(rank: int, job_id: str, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    model, opt = build()
    # 1. every rank creates its own store (local rank = rank on one node; n_local = ranks of the node)
    ro = RetainedOptimizer.create(opt, CONFIG, job_id=job_id, rank=rank, local_rank=rank, n_local=WORLD,
                                  barrier=barrier)
    barrier()
    # 2. local rank 0 encodes tier 2 (one stripe per page, across the node's stores)
    if rank == 0:
        peers = [ro.store] + [RetainedStore.attach(job_id, r) for r in range(1, WORLD)]
        encode_tier2(peers, ParityCodes(ro.store))
        for peer in peers[1:]:
            peer.close()
    barrier()
    ro.store.mark_complete()  # 3. set-up done: recovery refuses a store without this mark
    train(model, ro, 0, 4)
    set_hook(lambda name, context: os._exit(9) if name == "chunk.tier1_partial" else None)
    train(model, ro, 4, 5)  # both ranks die in the middle of iteration 4's update
    os._exit(0)


def main() -> None:
    torch.set_num_threads(1)
    build()  # before forking: the ranks then share the parent's already imported optimizer machinery
    job_id = new_job_id()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(rank, job_id, port)
            finally:
                os._exit(1)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    try:
        # 4. the node's stores are recovered together: tier 2 spans them
        stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
        reports = recover_node(stores)
        for report in reports.values():
            print(report.summary())
        resume = {rep.resume_iteration for rep in reports.values()}
        assert resume == {5}, resume
        models = []
        for store in stores.values():
            model, opt = build()
            RetainedOptimizer(opt, store).bind(adopt=True)
            models.append(model)
        same = all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        print(f"both ranks resume at iteration {resume.pop()} with identical weights: {same}")
        for store in stores.values():
            store.close()
        if not same:
            raise SystemExit(1)
    finally:
        unlink_segments(job_id)  # free the job's retained memory, tier 2 included


if __name__ == "__main__":
    main()
