"""Retained bytes per rank: DDP (a full replica per rank), ZeRO-1 (the params a rank owns) and
FSDP2 (the rank's local shards).

Pure layout arithmetic (the model is built on the meta device, nothing is allocated): for each
world size, the store one rank allocates -- data (params, grads, AdamW state), undo buffer,
tier-1 parity, metadata -- plus its share of the node's tier-2 parity (one node of ``world``
ranks). Prints a table and, per world size, the bytes times ``world`` over the DDP bytes
(1.00 = exactly 1/world of a replica; page rounding, padding and the fixed metadata make it
drift up as shards get small). ZeRO-1 partitions by whole parameters (ZeroRedundancyOptimizer's
greedy rule, reproduced here), and every rank's store is sized to the widest share (tier 2
needs one page map per node), so its figure follows the largest parameter once the world grows.

    python benchmarks/sharded_memory.py [--dim 1024] [--vocab 32000] [--layers 4] [--page-kib 256]
"""

from __future__ import annotations

import argparse

import torch

from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.layout import StoreLayout, build_layout
from leto_lightning.retained.owned import owned_layout
from leto_lightning.retained.shards import LocalShard, shard_layout
from leto_lightning.retained.spec import StoreSpec

MiB = 2**20
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False}


def model(vocab: int, dim: int, layers: int) -> torch.nn.Module:
    with torch.device("meta"):
        blocks = [torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim),
                                      torch.nn.LayerNorm(dim)) for _ in range(layers)]
        return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *blocks, torch.nn.Linear(dim, vocab))


def ddp_layout(net: torch.nn.Module, config: RetainedConfig) -> StoreLayout:
    return build_layout([[(n, tuple(p.shape), p.dtype) for n, p in net.named_parameters()]], family="adam",
                        group_options=[ADAMW], page_bytes=config.page_bytes, chunk_pages=config.chunk_pages)


def fsdp2_layout(net: torch.nn.Module, config: RetainedConfig, world: int) -> StoreLayout:
    """Rank 0's padded local shards (every rank's have the same shapes)."""
    shards = []
    for name, p in net.named_parameters():
        rows = -(-p.shape[0] // world)
        shards.append(LocalShard(name, tuple(p.shape), (rows, *p.shape[1:]), min(rows, p.shape[0]), p.dtype))
    return shard_layout([shards], family="adam", group_options=[ADAMW], page_bytes=config.page_bytes,
                        chunk_pages=config.chunk_pages)


def zero1_layout(net: torch.nn.Module, config: RetainedConfig, world: int) -> StoreLayout:
    """Rank 0's store under ZeRO-1: ZeroRedundancyOptimizer's partition (largest param first, to
    the rank with the fewest elements so far), regions sized to the widest share."""
    owned: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(world)]
    sizes = [0] * world
    for name, p in sorted(net.named_parameters(), key=lambda item: item[1].numel(), reverse=True):
        rank = sizes.index(min(sizes))
        owned[rank].append((name, tuple(p.shape)))
        sizes[rank] += p.numel()
    return owned_layout([[share] for share in owned], 0, dtype=torch.float32, family="adam", group_options=[ADAMW],
                        page_bytes=config.page_bytes, chunk_pages=config.chunk_pages)


def per_rank(layout: StoreLayout, config: RetainedConfig, world: int) -> dict[str, int]:
    spec = StoreSpec("bench", 0, 0, 0, world, layout, config.for_device("cpu"))
    sizes = dict(spec.sizes())
    sizes["parity2/rank"] = spec.parity2_bytes() // world if spec.tier2.enabled else 0
    sizes["total"] = sum(sizes.values())
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-kib", type=int, default=256)
    args = parser.parse_args()
    net = model(args.vocab, args.dim, args.layers)
    config = RetainedConfig(page_bytes=args.page_kib * 1024)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"model: {n_params / 1e6:.1f} M fp32 params ({4 * n_params / MiB:.0f} MiB), AdamW, "
          f"{config.page_bytes // 1024} KiB pages, tier 1 {config.data_pages}+{config.tier1_parity}, "
          f"tier 2 +{config.tier2_parity}")
    print(f"{'world':>5} {'strategy':>8} {'data':>9} {'undo':>7} {'parity1':>8} {'parity2/rank':>12} {'meta':>6} "
          f"{'total MiB':>10} {'x model':>8} {'x world/ddp':>12}")
    for world in (1, 2, 4, 8):
        ddp = per_rank(ddp_layout(net, config), config, world)
        rows = (("ddp", ddp), ("zero1", per_rank(zero1_layout(net, config, world), config, world)),
                ("fsdp2", per_rank(fsdp2_layout(net, config, world), config, world)))
        for strategy, s in rows:
            scaling = f"{s['total'] * world / ddp['total']:.3f}" if strategy != "ddp" else ""
            print(f"{world:>5} {strategy:>8} {s['data'] / MiB:>9.1f} {s['undo'] / MiB:>7.2f} "
                  f"{s['parity1'] / MiB:>8.1f} {s['parity2/rank'] / MiB:>12.1f} {s['meta'] / MiB:>6.2f} "
                  f"{s['total'] / MiB:>10.1f} {s['total'] / (4 * n_params):>8.2f} {scaling:>12}")


if __name__ == "__main__":
    main()
