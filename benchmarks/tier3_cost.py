"""What the cross-node tier costs: memory per rank and time per step, beside tiers 1 and 2.

    python benchmarks/tier3_cost.py [--nodes 2] [--ranks-per-node 2] [--dim 256] [--iterations 12]

``nodes x ranks-per-node`` processes on this machine (gloo on loopback, one thread each) train
the FSDP2 model of ``examples/plain_fsdp2.py`` twice over, side by side in the same processes:
one copy bound to retained memory with tiers 1 and 2 (``tier3_parity=0``), one with the
cross-node tier too (``tier3_parity=1``: each rank's prepared pages and metadata copied to the
next node every step). Steps alternate (A, B, A, B, ...) so drift hits both; the medians of the
step time and their ratio are printed, and the retained memory per rank by segment. Both copies
train the same model on the same batches: their final shards are checked equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leto_lightning.examples import plain_fsdp2
from leto_lightning.examples.plain_fsdp2 import VOCAB
from leto_lightning.models.tiny import rank_batch
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import new_job_id, unlink_segments
from leto_lightning.updater.fsdp2 import create_fsdp2

CONFIG = RetainedConfig(page_bytes=16384, data_pages=4, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The example's model and optimizer (``plain_fsdp2.build``), without dropout."""
    return plain_fsdp2.build(argparse.Namespace(dim=args.dim, hidden=2 * args.dim, blocks=args.blocks, dropout=0.0,
                                                lr=1e-3, hsdp=1))


def worker(rank: int, args: argparse.Namespace, port: int, jobs: tuple[str, str], out: dict) -> None:
    torch.set_num_threads(1)
    world = args.nodes * args.ranks_per_node
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    node, local = divmod(rank, args.ranks_per_node)
    runs = []
    for tier3, job in zip((0, 1), jobs):
        model, opt = build(args)
        bound = create_fsdp2(model, opt, RetainedConfig(**{**CONFIG.__dict__, "tier3_parity": tier3}), job_id=job,
                             rank=rank, node=node, local_rank=local, n_local=args.ranks_per_node,
                             barrier=dist.barrier)
        runs.append((model, opt, bound))
    times: list[list[float]] = [[], []]
    for it in range(args.iterations):
        for which, (model, opt, _bound) in enumerate(runs):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            x, y = rank_batch(rank, it, VOCAB)
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            dist.barrier()
            times[which].append(time.perf_counter() - t0)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(runs[0][0].parameters(),
                                                                        runs[1][0].parameters()))
    if rank == 0:
        sizes = [dict(bound.store.spec.sizes(), parity2=bound.store.spec.parity2_bytes() // args.ranks_per_node)
                 for _m, _o, bound in runs]
        out.update(times=times, same=same, sizes=sizes)
    for _m, _o, bound in runs:
        bound.store.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--iterations", type=int, default=12)
    args = p.parse_args()
    from leto_lightning.testing.launched import free_port

    jobs = (new_job_id("bench"), new_job_id("bench"))
    out = mp.Manager().dict()
    try:
        mp.spawn(worker, (args, free_port(), jobs, out), nprocs=args.nodes * args.ranks_per_node)
    finally:
        for job in jobs:
            unlink_segments(job)
    warm = slice(2, None)  # the first steps make the groups and fault the pages in
    base, tier3 = (statistics.median(t[warm]) for t in out["times"])
    mib = 1 << 20
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, FSDP2 model dim {args.dim}, {args.blocks} blocks; "
          f"median of {args.iterations - 2} steps each, alternating")
    print(f"step time: tiers 1+2 {base * 1e3:.1f} ms, + tier 3 {tier3 * 1e3:.1f} ms, ratio {tier3 / base:.3f}")
    print("retained memory per rank (MiB):   " + "  ".join(f"{k} {v / mib:.2f}" for k, v in out["sizes"][1].items()))
    sizes = out["sizes"][1]
    data = sizes["data"]
    print(f"  tier 1 {sizes['parity1'] / data:.2%} of the data, tier 2 {sizes['parity2'] / data:.2%}, "
          f"tier 3 {sizes['parity3'] / data:.2%} (two copies of the previous node's data and metadata)")
    print(f"final shards equal with and without tier 3: {out['same']}")


if __name__ == "__main__":
    main()
