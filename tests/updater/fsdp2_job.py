"""A tiny FSDP2 training job on gloo, run by forked ranks (one pytest process forks them).

Each rank writes what it ends with (local shards of the params, AdamW state, losses) to a file;
the parent compares the files. Uneven shards: the layers' dim 0 (5 and 3) do not divide by 2.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from leto_lightning.faults.points import set_hook
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.updater.fsdp2 import RetainedFSDP2, attach_fsdp2, create_fsdp2

WORLD = 2
STEPS = 4
ACCUMULATE = 2
MAX_NORM = 0.05  # small enough that every step clips
CONFIG = RetainedConfig(page_bytes=64, data_pages=2, tier1_parity=1, tier2_parity=1, record_bytes=4096)


@dataclass(frozen=True)
class Job:
    rendezvous: str  # FileStore path (no ports)
    out_dir: str
    steps: int
    retained: bool = False
    job_id: str = ""
    attach: bool = False  # re-bind to an existing (recovered) store and continue after its last commit
    bf16: bool = False  # MixedPrecisionPolicy(param_dtype=bfloat16): compute in bf16, fp32 master shards
    kills: tuple[tuple[int, str, int], ...] = ()  # (rank, point, n): rank SIGKILLs itself at point's n-th occurrence


class SelfKill:
    """A fault hook: SIGKILL this process (a real signal, nothing cleans up) at the ``n``-th
    occurrence of point ``name``."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n, self.seen = name, n, 0

    def __call__(self, name: str, context: dict) -> None:
        if name == self.name:
            self.seen += 1
            if self.seen == self.n:
                os.kill(os.getpid(), signal.SIGKILL)


def build(job: Job):
    """Model, optimizer, schedule, the binding (retained runs) and the first iteration to run."""
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if job.bf16 else MixedPrecisionPolicy()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    bound: RetainedFSDP2 | None = None
    if job.retained:
        rank = dist.get_rank()
        if job.attach:
            bound = attach_fsdp2(model, optimizer, job_id=job.job_id, rank=rank, barrier=dist.barrier)
        else:
            bound = create_fsdp2(model, optimizer, CONFIG, job_id=job.job_id, rank=rank, local_rank=rank,
                                 n_local=WORLD, barrier=dist.barrier)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    start = bound.iteration if bound is not None else 0
    for _ in range(start):  # a re-bound run: the schedule where the retained run left it
        schedule.step()
    return model, optimizer, schedule, bound, start


def batches(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(4, 6, generator=gen) for _ in range(ACCUMULATE)]


def train(job: Job, rank: int) -> None:
    torch.set_num_threads(1)
    for kill_rank, point, n in job.kills:
        if rank == kill_rank:
            set_hook(SelfKill(point, n))
    dist.init_process_group("gloo", store=dist.FileStore(job.rendezvous, WORLD), rank=rank, world_size=WORLD)
    try:
        model, optimizer, schedule, bound, start = build(job)
        losses, norms = train_steps(model, optimizer, schedule, rank, start, job.steps)
        result = {"losses": losses, "norms": norms, **final_state(model, optimizer, bound)}
        torch.save(result, os.path.join(job.out_dir, f"r{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_steps(model, optimizer, schedule, rank: int, start: int, stop: int) -> tuple[list, list]:
    """Iterations ``[start, stop)``: accumulate, clip, step, zero, schedule. Returns the losses
    and the gradient norms."""
    losses, norms = [], []
    for step in range(start, stop):
        for x in batches(rank, step):
            loss = model(x).pow(2).mean() / ACCUMULATE
            loss.backward()
            losses.append(loss.detach().clone())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm.clone())
        optimizer.step()  # retained: the binding's chunk transactions
        optimizer.zero_grad()
        schedule.step()
    return losses, norms


def final_state(model, optimizer, bound: RetainedFSDP2 | None) -> dict:
    """Local real rows of every param and of its AdamW state. Bound, the optimizer shows the
    same DTensor params and state as plain FSDP2 (views of the retained padded shards, whose
    padding rows must be zero)."""
    params = [p for _, p in model.named_parameters()]
    out: dict = {"params": [p.to_local().clone() for p in params], "state": []}
    for p in params:
        st = optimizer.state[p]
        out["state"].append({k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()})
    if bound is None:
        return out
    out.update(retained_facts(model, optimizer, bound))
    return out


def retained_facts(model, optimizer, bound: RetainedFSDP2) -> dict:
    """Where the bound tensors live, the padding rows, the store's progress."""
    params = [p for _, p in model.named_parameters()]
    data = bound.store.data
    lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
    state = [v for p in params for k, v in optimizer.state[p].items() if k != "step"]
    out: dict = {"in_store": all(lo <= t.to_local().data_ptr() < hi for t in (
        *params, *(p.grad for p in params), *state))}
    out["groups_hold_params"] = [q for g in optimizer.param_groups for q in g["params"]] == params
    out["padding_zero"] = True
    lay = bound.store.layout
    for slot, p in zip(lay.params, params):
        rows = p.to_local().shape[0]
        for kind in lay.segments[slot.segment].kinds:
            if kind != "grad":
                out["padding_zero"] &= bool((bound.store.param_view(slot, kind)[rows:] == 0).all())
    out["iteration"] = bound.iteration
    out["versions"] = bound.store.versions().tolist()
    out["n_chunks"] = lay.n_chunks
    return out


def run_ranks(job: Job, timeout: float = 90.0, target: Callable[[Job, int], None] | None = None) -> dict[int, int]:
    """Fork one child per rank running ``target`` (``train``); reap every one by pid. Returns
    rank -> exit code."""
    return fork_ranks(WORLD, lambda rank: (target or train)(job, rank), timeout)


def fork_ranks(world: int, fn: Callable[[int], object], timeout: float,
               error_file: Callable[[int], str] | None = None) -> dict[int, int]:
    """Fork one child per rank running ``fn(rank)``: exit 0, or 1 after printing the traceback
    (also written to ``error_file(rank)`` when given). Every child reaped by pid (``reap``);
    returns rank -> exit code."""
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn(rank)
                code = 0
            except BaseException:
                traceback.print_exc()
                if error_file is not None:
                    with open(error_file(rank), "w") as f:
                        f.write(traceback.format_exc())
            finally:
                os._exit(code)
        pids[rank] = pid
    return reap(pids, timeout)


def reap(pids: dict[int, int], timeout: float) -> dict[int, int]:
    """Wait for every pid until ``timeout``; when a rank dies by a signal, SIGKILL the others
    (they would wait for it in a collective), as for any still running at the deadline."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(codes) < len(pids) and time.monotonic() < deadline:
            for rank, pid in pids.items():
                if rank not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
                        if codes[rank] < 0:
                            break
            if any(code < 0 for code in codes.values()):
                break
            time.sleep(0.02)
    finally:
        for rank, pid in pids.items():
            if rank not in codes:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[rank] = -signal.SIGKILL
    return codes
