"""Distributed checkpoints (``torch.distributed.checkpoint``) of the FSDP2 job (``fsdp2_job``).

``save``: each rank trains a plain FSDP2 model and a retained (bound) one side by side for
``Job.steps`` iterations and writes both with unchanged torch code (``dcp.save`` of
``get_state_dict``). ``restart`` (new processes, new job ids, fresh stores): each rank loads
four models from those checkpoints -- bound from the bound one (torch's own calls inside
``RetainedFSDP2.restoring``), bound from the plain one (``RetainedFSDP2.load_checkpoint``),
plain from the bound one, bound from the bound run's state pickled per rank (new tensors, so
they are copied in: ``RetainedFSDP2.load_state_dict``) -- and trains each to ``STEPS``.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from leto_lightning.faults.points import set_hook

from .fsdp2_job import STEPS, WORLD, Job, SelfKill, build, final_state, retained_facts, train_steps

PLAIN, RETAINED, FILES = "plain", "retained", "files"  # FILES: the bound run's state, torch.save per rank
# restart variants: (name, the model's kind, the checkpoint it loads)
RESTARTS = (("bound_from_bound", RETAINED, RETAINED), ("bound_from_plain", RETAINED, PLAIN),
            ("plain_from_bound", PLAIN, RETAINED), ("bound_from_files", RETAINED, FILES))


def job_ids(job: Job) -> dict[str, str]:
    """One retained job id per retained model of ``job`` (``job.job_id`` is their prefix)."""
    return {name: f"{job.job_id}{i}" for i, name in enumerate((RETAINED, *(n for n, _, _ in RESTARTS)))}


def _group(job: Job, rank: int) -> None:
    torch.set_num_threads(1)
    for kill_rank, name, n in job.kills:
        if rank == kill_rank:
            set_hook(SelfKill(name, n))
    dist.init_process_group("gloo", store=dist.FileStore(job.rendezvous, WORLD), rank=rank, world_size=WORLD)


def save(job: Job, rank: int) -> None:
    """Train plain and bound to ``job.steps``; ``dcp.save`` each into ``out_dir/<kind>``."""
    _group(job, rank)
    try:
        result = {}
        for kind in (PLAIN, RETAINED):
            variant = dataclasses.replace(job, retained=kind == RETAINED, job_id=job_ids(job)[RETAINED])
            model, optimizer, schedule, bound, _ = build(variant)
            losses, _ = train_steps(model, optimizer, schedule, rank, 0, job.steps)
            model_state, optim_state = get_state_dict(model, optimizer)  # unchanged torch code
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(job.out_dir, kind))
            if bound is not None:  # as Accelerate's use_dcp=False: each rank pickles its sharded state
                torch.save(bound.state_dict(copy=True), _files(job, rank))
            result[kind] = {"losses": losses, **final_state(model, optimizer, bound)}
        torch.save(result, os.path.join(job.out_dir, f"save_r{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def restart(job: Job, rank: int) -> None:
    """Each ``RESTARTS`` variant: a fresh model (and store), the checkpoint loaded, the
    schedule where the checkpoint left it, trained from ``job.steps`` to ``STEPS``."""
    _group(job, rank)
    try:
        result = {}
        for name, kind, source in RESTARTS[:1] if job.kills else RESTARTS:  # a kill: the first one only
            variant = dataclasses.replace(job, retained=kind == RETAINED, job_id=job_ids(job)[name])
            model, optimizer, schedule, bound, _ = build(variant)  # a new store: iteration 0
            path = os.path.join(job.out_dir, source)
            loaded: dict = {}
            if name == "bound_from_plain":
                bound.load_checkpoint(path)  # iteration from AdamW's loaded step
            elif name == "bound_from_files":  # new tensors: copied into the retained views
                bound.load_state_dict(torch.load(_files(job, rank), weights_only=False))
            elif bound is not None:
                with bound.restoring(iteration=job.steps, payload={"from": path}):
                    _torch_load(model, optimizer, path)
            else:
                _torch_load(model, optimizer, path)
            if bound is not None:
                entry = bound.store.record.read().progress
                loaded = {"iteration": bound.iteration, "complete": bound.store.is_complete(),
                          "record": (str(entry.status), entry.iteration, entry.payload),
                          **retained_facts(model, optimizer, bound)}
            for _ in range(job.steps):
                schedule.step()
            losses, _ = train_steps(model, optimizer, schedule, rank, job.steps, STEPS)
            result[name] = {"losses": losses, "loaded": loaded, **final_state(model, optimizer, bound)}
        torch.save(result, os.path.join(job.out_dir, f"restart_r{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _files(job: Job, rank: int) -> str:
    return os.path.join(job.out_dir, f"{FILES}_r{rank}.pt")


def _torch_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """What Lightning's and Accelerate's FSDP2 loaders do: ``dcp.load`` into the model's and
    optimizer's own state dict, then ``set_state_dict``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
