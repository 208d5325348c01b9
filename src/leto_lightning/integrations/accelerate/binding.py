"""Binding the prepared model and optimizer to this rank's retained store.

Why after ``prepare()`` (after device placement and the DDP wrap) and not before: Accelerate
moves parameters (``cpu:0`` copies a ``cpu`` tensor), round-trips the optimizer's state dict
and wraps the model; views bound before any of it would be replaced. DDP keeps the parameter
objects, so re-pointing ``p.data`` and ``p.grad`` at retained views afterwards keeps every
gradient DDP reduces in retained memory (with ``gradient_as_bucket_view=False``, DDP copies the
reduced bucket into the existing ``.grad``).

Three cases:

- a new store (fresh start): the values after DDP's broadcast are copied in, parity encoded
  (tier 2 across the node's ranks), the store marked complete, shadows told they may attach;
- a continuation (a shadow, or ``LETO_RESUME=retained``): attach, bind views only, wait for
  promotion fully built (level 3), then take the committed payload -- every rank's retained
  parameters are the same committed values, so DDP's broadcast of the shadow's own initial
  weights (among the shadows) never reaches retained memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...env import ProcessSettings, job_prefix
from ...retained.config import RetainedConfig
from ...retained.shm import new_job_id
from ...retained.store import RetainedStore, StoreSpec
from ...runtime.engine import RankPlace, TrainerEngine
from ...updater.retained_optimizer import RetainedOptimizer, config_for, layout_for


def bind_replicated(engine: TrainerEngine, optimizer: torch.optim.Optimizer, config: RetainedConfig, job_id: str,
                    place: RankPlace, names: dict, barrier: Callable[[], None] | None,
                    payload_fn: Callable[[], Any], rollback_window: bool, continuing: bool) -> RetainedOptimizer:
    """This rank's store through the engine: a new one (bound, encoded -- tier 2 too -- and
    marked complete), or, continuing, the existing one's views (``resume()`` once promoted)."""

    def bind(store: RetainedStore) -> RetainedOptimizer:
        ro = RetainedOptimizer(optimizer, store, barrier, payload_fn, rollback_window=rollback_window,
                               settings=ProcessSettings.from_env())
        ro.bind(adopt=continuing, resume=False)
        return ro

    if continuing:
        return engine.attach(job_id, place.rank, bind)
    config = config_for(config, optimizer)
    config.check_devices(place.local_world_size)
    layout = layout_for(optimizer, config, names, whole_state=rollback_window)
    spec = StoreSpec(job_id, place.rank, place.node, place.local_rank, place.local_world_size, layout, config)
    return engine.create(spec, bind, barrier=barrier, attach_with="LETO_RESUME=retained")


def agreed_job_id(world_size: int) -> str:
    """A fresh job id, the same on every rank (rank 0's): tier 2 attaches the peers' stores."""
    job = [new_job_id(job_prefix())]
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(job, src=0)
    return job[0]


def param_names(models: list[torch.nn.Module]) -> dict:
    """Parameter -> name, from the unwrapped models (names in the store's layout and reports)."""
    names: dict = {}
    for model in models:
        inner = getattr(model, "module", model)
        for name, p in inner.named_parameters():
            names.setdefault(p, name)
    return names
