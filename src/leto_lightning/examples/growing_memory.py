"""A plain-PyTorch job whose memory grows from some iteration on (shadow memory reclaim).

    leto launch --memory-budget 1500MiB growing_memory.py --warm-mib 384 --grow-at 5 --grow-mib 512

Every trainer holds a pre-warmed working set (``--warm-mib``: what an allocator pool or a
device context is on a GPU) once it is built -- an L3 shadow holds it while it waits, an L2/L1
shadow builds it after its promotion. From iteration ``--grow-at`` on the active trainer also
keeps ``--grow-step-mib`` more per iteration up to ``--grow-mib`` (the activations of a
larger batch, a cache). Neither buffer enters the arithmetic:
the weights end bit-identical whatever the shadows did. Final state: RUN_DIR/final_rank<r>.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import leto_lightning.runtime as leto
from leto_lightning.models.tiny import TinyLM
from leto_lightning.models.tiny import rank_batch as batch
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.runtime.storage import atomic_torch_save

MIB = 1 << 20


def touched(mib: int) -> torch.Tensor:
    """``mib`` MiB of private memory, every page written (resident, not just reserved)."""
    return torch.ones(mib * MIB, dtype=torch.uint8) if mib else torch.empty(0, dtype=torch.uint8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--warm-mib", type=int, default=256)
    p.add_argument("--grow-at", type=int, default=5)
    p.add_argument("--grow-mib", type=int, default=384, help="what the trainer holds in addition once grown")
    p.add_argument("--grow-step-mib", type=int, default=48, help="growth per iteration from --grow-at on")
    p.add_argument("--sleep", type=float, default=0.05, help="extra seconds per iteration")
    args = p.parse_args()
    torch.set_num_threads(1)
    session = leto.init()  # L1/L2 shadows wait here
    session.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM(vocab=97, dim=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warm = touched(args.warm_mib)  # built before protect(): an L3 shadow waits holding it
    cfg = RetainedConfig(page_bytes=16384, data_pages=4, tier1_parity=1, tier2_parity=0, record_bytes=1 << 16)
    train = session.protect(model, opt, cfg)
    grown: list[torch.Tensor] = []
    chunks = -(-args.grow_mib // args.grow_step_mib) if args.grow_mib else 0
    with open(os.path.join(session.env.run_dir, f"memory_rank{session.rank}.jsonl"), "a") as log:
        for it in range(train.start_iteration, args.iterations):
            train.begin(it)
            while len(grown) < min(max(it - args.grow_at + 1, 0), chunks):  # a function of the iteration alone
                grown.append(touched(min(args.grow_step_mib, args.grow_mib - len(grown) * args.grow_step_mib)))
            x, y = batch(session.rank, it, 97)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            time.sleep(args.sleep)
            train.all_reduce_grads()
            train.step(payload={"it": it})
            log.write(json.dumps({"it": it, "gen": session.env.generation, "t": time.time(),
                                  "held_mib": (warm.numel() + sum(g.numel() for g in grown)) // MIB}) + "\n")
            log.flush()
    atomic_torch_save({"params": [p.detach().clone() for p in model.parameters()], "optimizer": opt.state_dict()},
                      os.path.join(session.env.run_dir, f"final_rank{session.rank}.pt"))
    train.finish()


if __name__ == "__main__":
    main()
