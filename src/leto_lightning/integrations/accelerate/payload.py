"""The resume payload of ``LetoAccelerator``: what ``save_state`` records, plus the data position.

Weights, gradients and optimizer state are retained memory; everything else a resume needs is
the payload recorded with each committed step:

- ``step``: ``accelerator.step`` (Accelerate's micro-step counter, which decides the next sync);
- ``hparams``: the optimizer's param-group settings (the LR schedulers' output);
- ``schedulers``, ``scaler``, ``custom``: the state dicts of the prepared schedulers, the
  GradScaler and every object given to ``register_for_checkpointing`` (``custom`` is None in a
  checkpoint's payload: Accelerate saves and loads those objects itself);
- ``rng``/``loader``: the random state and the data position (``loader.Position``).

Two kinds. ``"prepare"`` is captured inside ``optimizer.step()`` when the transaction prepares
the update: the loop has not yet stepped the schedulers (and the GradScaler not yet run
``update()``). A resume from it finishes the step the way Accelerate would: each prepared
scheduler steps once as after ``opt.step()`` (``AcceleratedScheduler.step`` with
``sync_gradients`` set: ``num_processes`` times unless ``split_batches``), and the scaler gets
the ``update()`` of a step without inf/nan (only those commit). ``"boundary"`` is captured
when the loop fetches its next batch, after all of the user's code of the step ran; it
replaces the ``prepare`` payload of the same iteration and needs nothing finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...retained.torch_internals import GROWTH_TRACKER, mark_optimizer_stepped
from ...runtime.rng import rng_states, set_rng_states
from ...updater.retained_optimizer import hyperparameters
from .internals import checkpointed_objects, mark_step_not_skipped, prepared_schedulers, set_sync_gradients
from .loader import Position


class ResumableAccelerator(Protocol):
    """What a payload reads from and puts back into ``LetoAccelerator`` (a protocol: this module
    sits below it). Accelerate's own ``step``, ``scaler`` and ``gradient_state`` (its schedulers
    and registered objects through ``internals``); Leto's prepared optimizer, loaders, recovery
    count and store."""

    step: int
    scaler: Any
    gradient_state: Any
    leto_optimizer: Any
    leto_loaders: list[Any]
    leto_recoveries: int
    leto_recovery_log: Any
    retained: Any

PAYLOAD_VERSION = 1
PREPARE, BOUNDARY = "prepare", "boundary"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed loop continues: ``epoch`` (the epoch of the next batch), ``batch`` (the
    batches of that epoch already trained), ``step`` (optimizer steps committed), ``micro_step``
    (``accelerator.step``); the prepared data loaders already start at ``batch``."""

    epoch: int
    batch: int
    step: int
    micro_step: int


def capture(acc: ResumableAccelerator, kind: str, loader: Any | None) -> dict:
    """The payload now (see module doc); ``loader``: the loader whose batch the loop trains on."""
    return {
        "version": PAYLOAD_VERSION, "kind": kind, "step": int(acc.step),
        "hparams": hyperparameters(acc.leto_optimizer.optimizer),
        "schedulers": [s.scheduler.state_dict() for s in prepared_schedulers(acc)],
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        "custom": [obj.state_dict() for obj in checkpointed_objects(acc)],
        "rng": rng_states(),
        "loader": loader.leto_position() if loader is not None else None,
        "epochs": [int(getattr(dl, "iteration", 0)) for dl in acc.leto_loaders],
        "recoveries": acc.leto_recoveries,
        "recovery_log": acc.leto_recovery_log.state(),
    }


def restore(acc: ResumableAccelerator, payload: dict) -> ResumePoint:
    """Put back everything but retained memory; position the prepared loaders."""
    acc.step = payload["step"]
    apply_param_groups(acc.leto_optimizer.optimizer, payload["hparams"])
    for sched, state in zip(prepared_schedulers(acc), payload["schedulers"]):
        sched.scheduler.load_state_dict(state)
    if acc.scaler is not None and payload["scaler"] is not None:
        acc.scaler.load_state_dict(payload["scaler"])
    # custom is None in a checkpoint's payload (Accelerate loads those objects itself)
    for obj, state in zip(checkpointed_objects(acc), payload["custom"] or ()):
        obj.load_state_dict(state)
    acc.leto_recovery_log.restore(payload.get("recovery_log"))
    if payload["kind"] == PREPARE:
        finish_step(acc)
    for dl, epoch in zip(acc.leto_loaders, payload["epochs"]):
        dl.iteration = epoch
    where = payload["loader"]
    if where is None:
        set_rng_states(payload["rng"])
        return ResumePoint(0, 0, acc.retained.iteration, acc.step)
    at_yield = payload["kind"] == BOUNDARY
    dl = acc.leto_loaders[where["index"]]
    dl._leto_pending = Position(where["yielded"], where["epoch_rng"], where["rng"], at_yield)
    return ResumePoint(where["epoch"], where["yielded"], acc.retained.iteration, acc.step)


def finish_step(acc: ResumableAccelerator) -> None:
    """What the loop and Accelerate did after a committed ``prepare`` payload: the schedulers'
    step after ``opt.step()`` and the scaler's ``update()`` of a step that was not skipped."""
    state = acc.gradient_state
    synced = state.sync_gradients
    set_sync_gradients(state, True)
    opt = acc.leto_optimizer
    mark_step_not_skipped(opt)
    mark_optimizer_stepped(opt.optimizer)  # what torch's LR-scheduler step wrapper would have set
    try:
        for sched in prepared_schedulers(acc):
            sched.step()
    finally:
        set_sync_gradients(state, synced)
    if acc.scaler is not None:
        acc.scaler.load_state_dict(scaler_after_step(acc.scaler.state_dict()))


def scaler_after_step(state: dict) -> dict:
    """``GradScaler.update()`` after a step without inf/nan: count it, grow the scale every
    ``growth_interval`` such steps (torch's ``_amp_update_scale_``)."""
    if not state or state.get("scale") is None:  # a disabled scaler's state is empty
        return state
    state = dict(state)
    tracker = int(state[GROWTH_TRACKER]) + 1
    if tracker == int(state["growth_interval"]):
        state["scale"] = float(state["scale"]) * float(state["growth_factor"])
        tracker = 0
    state[GROWTH_TRACKER] = tracker
    return state


def apply_param_groups(optimizer: torch.optim.Optimizer, hparams: list[dict]) -> None:
    """The recorded settings (lr, betas, ...) back into the param groups; tensors stay tensors."""
    for group, values in zip(optimizer.param_groups, hparams):
        for key, value in values.items():
            if key.startswith("_leto_"):
                continue
            if isinstance(group.get(key), torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = value
