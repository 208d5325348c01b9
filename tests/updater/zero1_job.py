"""A tiny DDP + ZeroRedundancyOptimizer job on gloo, run by forked ranks (one pytest process).

Three kinds, run one after the other in the same ranks (one process group, one fork per rank):
``"adamw"`` (DDP + torch AdamW), ``"zero"`` (DDP + ZeroRedundancyOptimizer(AdamW)), ``"retained"``
(the same, bound by ``updater.zero1``). Each rank writes, per kind, what it ends with (every
param, the AdamW state of the params it steps, losses) to a file; the parent compares the files.
ZeRO's greedy partition of the four params is unequal: rank 0 owns the 5x6 weight, rank 1 the rest.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from leto_lightning.faults.points import set_hook
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.updater.zero1 import RetainedZeRO1, attach_zero1, create_zero1

from .fsdp2_job import SelfKill, fork_ranks

WORLD = 2
STEPS = 4
ACCUMULATE = 2
MAX_NORM = 0.05  # small enough that every step clips
CONFIG = RetainedConfig(page_bytes=64, data_pages=2, tier1_parity=1, tier2_parity=1, record_bytes=4096)


@dataclass(frozen=True)
class Job:
    rendezvous: str  # FileStore path (no ports)
    out_dir: str
    steps: int = STEPS
    # run one after the other in the same ranks: "adamw" | "zero" | "retained", and "zero+groups" /
    # "retained+groups" (two param groups: weights with weight decay, biases without)
    kinds: tuple[str, ...] = ("zero",)
    job_id: str = ""
    attach: bool = False  # re-bind to an existing (recovered) store and continue after its last commit
    kills: tuple[tuple[int, str, int], ...] = ()  # (rank, point, n): rank SIGKILLs itself at point's n-th occurrence


def build(job: Job, kind: str):
    """DDP model, optimizer, schedule, the binding (retained runs) and the first iteration."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = DistributedDataParallel(net)
    names = {p: n for n, p in net.named_parameters()}
    bound: RetainedZeRO1 | None = None
    params: list = list(model.parameters())
    if kind.endswith("+groups"):  # ZeRO partitions group by group: rank 0 then owns nothing in the second
        params = [{"params": [p for n, p in net.named_parameters() if n.endswith("weight")]},
                  {"params": [p for n, p in net.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    if kind == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    else:
        optimizer = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    if kind.startswith("retained") and job.attach:
        bound = attach_zero1(optimizer, job_id=job_of(job, kind), barrier=dist.barrier, names=names)
    elif kind.startswith("retained"):
        bound = create_zero1(optimizer, CONFIG, job_id=job_of(job, kind), local_rank=dist.get_rank(), n_local=WORLD,
                             barrier=dist.barrier, names=names)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    start = bound.iteration if bound is not None else 0
    for _ in range(start):  # a re-bound run: the schedule where the retained run left it
        schedule.step()
    return model, optimizer, schedule, bound, start


def job_of(job: Job, kind: str) -> str:
    """The retained job id of a kind: each retained kind of one run has its own stores."""
    return job.job_id + ("g" if kind.endswith("+groups") else "")


def batches(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(4, 6, generator=gen) for _ in range(ACCUMULATE)]


def train(job: Job, rank: int) -> None:
    torch.set_num_threads(1)
    for kill_rank, name, n in job.kills:
        if rank == kill_rank:
            set_hook(SelfKill(name, n))
    dist.init_process_group("gloo", store=dist.FileStore(job.rendezvous, WORLD), rank=rank, world_size=WORLD)
    try:
        for kind in job.kinds:
            result = train_one(job, kind, rank)
            torch.save(result, os.path.join(job.out_dir, f"r{rank}-{kind}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_one(job: Job, kind: str, rank: int) -> dict:
    model, optimizer, schedule, bound, start = build(job, kind)
    losses = []
    for step in range(start, job.steps):
        for i, x in enumerate(batches(rank, step)):
            with model.no_sync() if i < ACCUMULATE - 1 else contextlib.nullcontext():
                loss = model(x).pow(2).mean() / ACCUMULATE
                loss.backward()
            losses.append(loss.detach().clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()  # retained: chunk transactions over the owned params, then ZeRO's broadcast
        optimizer.zero_grad()
        schedule.step()
    return {"losses": losses, **final_state(model.module, optimizer, bound)}


def final_state(net: torch.nn.Module, optimizer: torch.optim.Optimizer, bound: RetainedZeRO1 | None) -> dict:
    """Every param; the AdamW state of the params this rank steps, by param name."""
    names = {p: n for n, p in net.named_parameters()}
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    out: dict = {"params": {n: p.detach().clone() for n, p in net.named_parameters()},
                 "state": {names[p]: {k: v.clone() for k, v in local.state[p].items()}
                           for g in local.param_groups for p in g["params"]}}
    if bound is not None:
        data = bound.store.data
        lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
        owned = [p for g in local.param_groups for p in g["params"]]
        out["in_store"] = all(lo <= p.data_ptr() < hi and lo <= p.grad.data_ptr() < hi for p in owned)
        mine = set(map(id, owned))
        out["replicas_outside"] = all(not lo <= p.data_ptr() < hi for p in net.parameters() if id(p) not in mine)
        out["iteration"] = bound.iteration
        out["versions"] = bound.store.versions().tolist()
    return out


def errors(out_dir: str) -> str:
    """The tracebacks of ranks that failed with an exception (``run_ranks`` writes them)."""
    found = sorted(f for f in os.listdir(out_dir) if f.endswith(".err"))
    return "".join(open(os.path.join(out_dir, f)).read() for f in found)


def run_ranks(job: Job, timeout: float = 90.0) -> dict[int, int]:
    """Fork one child per rank running ``train``; reap every one by pid (``fsdp2_job.fork_ranks``)."""
    return fork_ranks(WORLD, lambda rank: train(job, rank), timeout,
                      error_file=lambda rank: os.path.join(job.out_dir, f"r{rank}.err"))  # for the test's message
