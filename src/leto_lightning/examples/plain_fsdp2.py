"""A plain-PyTorch FSDP2 training loop that survives failures in place.

    leto launch --nproc-per-node 2 plain_fsdp2.py --iterations 40
    torchrun --nproc-per-node 2 plain_fsdp2.py --iterations 40 --out runs/plain   # the same, no Leto

Every block and the root are sharded with ``fully_shard`` (the vocabulary's 97 rows and the
MLP's hidden width do not divide by the world size: uneven shards). Each iteration accumulates
gradients over micro-batches, clips their global norm, steps AdamW and an LR schedule; the blocks
use dropout, so the RNG stream is part of the resume state. Under ``leto launch`` each rank's
local shards (params, gradients, AdamW state) live in its retained store: a killed trainer's
shadow continues from them, bit-identical to the run without failures, and that run is
bit-identical to the same script under torchrun. Deterministic on CPU (gloo, one thread).

Writes ``loss_rank<r>.jsonl`` (one line per iteration) and, at the end, ``final_rank<r>.pt``:
this rank's local shards -- the real rows of every parameter and of its AdamW state. With
``--checkpoint-every N`` (under ``leto launch``) it saves distributed checkpoints from the
retained views, and after the agent's fallback to the checkpoint path (a failure that is not a
HOF) it continues from the newest one every rank finished, exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import IO, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import leto_lightning.runtime as leto
from leto_lightning.env import under_launcher
from leto_lightning.models.tiny import rank_batch
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.runtime.protected import ProtectedTraining
from leto_lightning.runtime.session import load_checkpoint_file
from leto_lightning.runtime.storage import atomic_torch_save

VOCAB = 97  # odd: the embedding's and the head's rows shard unevenly
CONFIG = RetainedConfig(page_bytes=1024, data_pages=4, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)


class Block(torch.nn.Module):
    """Pre-norm MLP block with dropout on its residual branch."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(h)))))


class ShardedLM(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int, dropout: float) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, hidden, dropout) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--dim", type=int, default=24)
    p.add_argument("--hidden", type=int, default=50)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--max-norm", type=float, default=0.5, help="gradient clipping (global norm)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5, help="iterations of linear LR warm-up, then 1/sqrt decay")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="under leto launch: a distributed checkpoint every N iterations (the agent's fallback)")
    p.add_argument("--out", default=None, help="where outputs go (default: the run dir under leto launch)")
    p.add_argument("--tier3", action="store_true",
                   help="under leto launch on several nodes: keep each rank's state on the next node too (the "
                        "cross-node tier, RetainedConfig(tier3_parity=1)): a spare rebuilds a lost node's shards")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP: R replica groups, each sharding the model over WORLD_SIZE / R ranks (a 2-D mesh; lay "
                        "replicas out across nodes and a spare rebuilds a lost node's shards from another group)")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[ShardedLM, torch.optim.AdamW]:
    """The model, sharded over every rank (each block, then the root) -- or, with ``--hsdp R``,
    over each of R replica groups -- and its optimizer."""
    world = dist.get_world_size()
    if args.hsdp < 1 or world % args.hsdp:
        raise SystemExit(f"--hsdp {args.hsdp}: the number of replica groups must divide the world size {world}")
    mesh = (init_device_mesh("cpu", (world,)) if args.hsdp == 1 else
            init_device_mesh("cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard")))
    torch.manual_seed(0)  # the same initial weights on every rank, in every process
    model = ShardedLM(args.dim, args.hidden, args.blocks, args.dropout)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def schedule_for(optimizer: torch.optim.Optimizer, base_lr: float, warmup: int,
                 start: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up then decay of ``base_lr``, positioned at iteration ``start`` (a resumed run
    continues it; a loaded checkpoint's param groups need not carry the base)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = base_lr  # what LambdaLR(last_epoch >= 0) scales

    def factor(it: int) -> float:
        return (it + 1) / warmup if it < warmup else (warmup / (it + 1)) ** 0.5

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start - 1)


def local_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's real rows of every parameter and of its optimizer state, as plain tensors
    (a retained optimizer's parameters are padded local shards: cut to the real rows)."""
    params = [cast(DTensor, p).to_local() for p in model.parameters()]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (local, p) in enumerate(zip(params, (p for g in optimizer.param_groups for p in g["params"]))):
        rows = local.shape[0]
        state[i] = {}
        for key, value in optimizer.state[p].items():
            value = value.to_local() if isinstance(value, DTensor) else value
            state[i][key] = (value[:rows] if value.dim() else value).detach().clone()
    return {"params": [p.detach().clone() for p in params], "optimizer": {"state": state}}


def save_checkpoint(train: ProtectedTraining, out: str, rank: int, iteration: int, payload: dict) -> None:
    """A distributed checkpoint of every rank's shards (``dcp.save`` from the retained views),
    then this rank's note that it finished it (where to continue, and the RNG stream)."""
    assert train.sharded is not None  # an FSDP2 model
    path = os.path.join(out, "checkpoints", f"fsdp2-{iteration}")
    train.sharded.save_checkpoint(path)
    atomic_torch_save({"iteration": iteration, "payload": payload}, os.path.join(path, f"done_rank{rank}.pt"))


def newest_checkpoint(out: str, rank: int) -> tuple[str, dict] | None:
    """The newest distributed checkpoint every rank finished (a crash during a save leaves a
    newer one some rank never finished), and this rank's note of it; None if there is none."""
    base = os.path.join(out, "checkpoints")
    names = os.listdir(base) if os.path.isdir(base) else []
    mine = [int(n.split("-")[1]) for n in names
            if n.startswith("fsdp2-") and os.path.exists(os.path.join(base, n, f"done_rank{rank}.pt"))]
    newest = torch.tensor(max(mine, default=0))
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    if not newest.item():
        return None
    path = os.path.join(base, f"fsdp2-{newest.item()}")
    return path, load_checkpoint_file(os.path.join(path, f"done_rank{rank}.pt"))


def protect(session: leto.Session, model: ShardedLM, optimizer: torch.optim.AdamW, out: str,
            tier3: bool = False) -> ProtectedTraining:
    """Under ``leto launch``: bind the shards to retained memory (after the agent's fallback to
    the checkpoint path: loaded from the newest distributed checkpoint, if any)."""
    config = dataclasses.replace(CONFIG, tier3_parity=1) if tier3 else CONFIG
    found = newest_checkpoint(out, dist.get_rank()) if session.resume_from_checkpoint else None
    if found is None:
        return session.protect(model, optimizer, config)  # L3 shadows wait here
    path, note = found
    return session.protect(model, optimizer, config, start_iteration=note["iteration"], payload=note["payload"],
                           checkpoint=path)


def train_loop(args: argparse.Namespace, model: ShardedLM, optimizer: torch.optim.AdamW,
               train: ProtectedTraining | None, rank: int, losses: IO[str], out: str) -> None:
    start = train.start_iteration if train is not None else 0
    schedule = schedule_for(optimizer, args.lr, args.warmup, start)
    if train is not None and train.payload is not None:
        resumed = cast(dict, train.payload)  # what step(payload=...) below recorded
        torch.set_rng_state(resumed["rng"])
        losses.write(json.dumps({"it": resumed["it"], "loss": resumed["loss"], "gen": -1}) + "\n")
    for it in range(start, args.iterations):
        if train is not None:
            train.begin(it)  # zeroes the retained gradients
        else:
            optimizer.zero_grad()
        total = torch.zeros(())
        for micro in range(args.accumulate):
            x, y = rank_batch(rank, it * args.accumulate + micro, VOCAB)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accumulate
            loss.backward()  # FSDP2 reduce-scatters into the (retained) gradient shards
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # before the step (prepare)
        payload = {"rng": torch.get_rng_state(), "it": it, "loss": total.item()}  # what a resume needs
        if train is not None:
            train.step(payload=payload)
        else:
            optimizer.step()
        schedule.step()
        losses.write(json.dumps({"it": it, "loss": total.item()}) + "\n")
        losses.flush()
        if train is not None and args.checkpoint_every and (it + 1) % args.checkpoint_every == 0:
            save_checkpoint(train, out, rank, it + 1, payload)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    session = None
    if under_launcher(os.environ):
        session = leto.init()  # shadows at L1/L2 wait here
        # A stalled peer is the agent's to detect (its heartbeat timeout), not gloo's
        session.init_process_group("gloo", timeout=300.0)
    else:
        dist.init_process_group("gloo")  # torchrun's environment (env://)
    rank = dist.get_rank()
    out = args.out or (session.env.run_dir if session is not None else "runs/plain_fsdp2")
    os.makedirs(out, exist_ok=True)
    model, optimizer = build(args)
    train = protect(session, model, optimizer, out, args.tier3) if session is not None else None
    with open(os.path.join(out, f"loss_rank{rank}.jsonl"), "a") as losses:
        train_loop(args, model, optimizer, train, rank, losses, out)
    atomic_torch_save(local_shards(model, optimizer), os.path.join(out, f"final_rank{rank}.pt"))  # never half-written
    if train is not None:
        train.finish()
    else:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
