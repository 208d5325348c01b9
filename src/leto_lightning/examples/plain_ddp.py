"""A plain-PyTorch data-parallel training loop that survives failures in place.

    leto launch --nproc-per-node 2 plain_ddp.py --iterations 50

Deterministic on CPU: the same command with and without failures ends with bit-identical
weights and optimizer state (written to RUN_DIR/final_rank<r>.pt). Dropout makes the RNG
stream part of the resume state; the batch of each (rank, iteration) is fixed, so the data
position is the iteration number.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import cast

import torch

import leto_lightning.runtime as leto
from leto_lightning.models.tiny import TinyLM
from leto_lightning.models.tiny import rank_batch as batch
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.runtime.storage import atomic_torch_save


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per iteration (slow it down)")
    args = p.parse_args()
    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    session = leto.init()  # shadows at L1/L2 wait here
    session.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM(vocab=97, dim=args.dim)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    start, payload = 0, None
    if session.resume_from_checkpoint and (ckpt := session.load_checkpoint()) is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start, payload = ckpt["iteration"], ckpt["payload"]
    cfg = RetainedConfig(page_bytes=16384, data_pages=4, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)
    train = session.protect(model, opt, cfg, start_iteration=start, payload=payload)
    losses = open(os.path.join(session.env.run_dir, f"loss_rank{session.rank}.jsonl"), "a")
    if train.payload is not None:
        resumed = cast(dict, train.payload)  # what step(payload=...) below recorded
        torch.set_rng_state(resumed["rng"])
        if "loss" in resumed:  # the last committed iteration may have died before logging
            losses.write(json.dumps({"it": resumed["it"], "loss": resumed["loss"], "gen": -1}) + "\n")
    for it in range(train.start_iteration, args.iterations):
        train.begin(it)
        x, y = batch(session.rank, it, 97)
        logits = model(torch.nn.functional.dropout(torch.ones(1), 0.5).sum().mul(0).long() + x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if args.sleep:  # stands for compute time: inside the compute phase, redone on recompute
            time.sleep(args.sleep)
        train.all_reduce_grads()
        train.step(payload={"rng": torch.get_rng_state(), "it": it, "loss": loss.item()})
        losses.write(json.dumps({"it": it, "loss": loss.item(), "gen": session.env.generation}) + "\n")
        losses.flush()
        if args.checkpoint_every and (it + 1) % args.checkpoint_every == 0:
            session.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": it + 1,
                                     "payload": {"rng": torch.get_rng_state()}})
    atomic_torch_save({"params": [p.detach().clone() for p in model.parameters()], "optimizer": opt.state_dict()},
                      os.path.join(session.env.run_dir, f"final_rank{session.rank}.pt"))  # never half-written
    train.finish()


if __name__ == "__main__":
    main()
