"""ZeRO-1 under ``LetoStrategy``: a ``ZeroRedundancyOptimizer`` returned by ``configure_optimizers``.

The strategy binds it through ``updater.zero1``: each rank's store holds the params it owns,
their grads and optimizer state; the step is ZeRO's (the owned shard's chunk transactions, then
the owners' broadcast). Resuming from retained memory, every replica is refreshed from its
owner (``after_adopt``) before the first forward: a restart (``ckpt_path="leto://retained"``, or
``LETO_RESUME=retained`` under ``leto launch``) refreshes *before* the DDP wrap, whose broadcast
from rank 0 then writes the values each rank holds; a shadow under ``leto launch`` binds views
only and refreshes once promoted (its DDP wrap broadcasts nothing): before promotion the owners'
views are still being written by the active trainers, and the broadcast is over the shadows'
own process group, which is the job's once they are promoted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ...env import ProcessSettings
from ...errors import ConfigurationError
from ...retained.config import RetainedConfig
from ...retained.layout import StoreLayout
from ...retained.store import RetainedStore
from ...updater.retained_optimizer import RetainedOptimizer, layout_for
from ...updater.zero1 import Partition, RetainedZeRO1, partition, zero1_layout


def zero1_partition(optimizer: torch.optim.Optimizer, module: torch.nn.Module, *, manual: bool) -> Partition | None:
    """Who owns which param (a collective), or None for a plain optimizer."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return None
    if manual:
        raise ConfigurationError("ZeroRedundancyOptimizer with manual optimization: LetoStrategy retains ZeRO-1 "
                                 "state in automatic optimization only; set automatic_optimization=True or use "
                                 "a plain torch.optim optimizer")
    return partition(optimizer, {p: n for n, p in module.named_parameters()})


def store_layout(optimizer: torch.optim.Optimizer, config: RetainedConfig, names: dict, manual: bool,
                 split: Partition | None) -> StoreLayout:
    """The layout of this rank's new store: its owned params under ZeRO-1, else every param."""
    if split is None:
        return layout_for(optimizer, config, names, whole_state=manual)
    assert isinstance(optimizer, ZeroRedundancyOptimizer)  # zero1_partition made the split
    return zero1_layout(optimizer, split, config)


def retained_for(optimizer: torch.optim.Optimizer, store: RetainedStore, barrier: Callable[[], None] | None,
                 payload: Callable[[], object], manual: bool, split: Partition | None) -> RetainedOptimizer:
    settings = ProcessSettings.from_env()
    if split is None:
        return RetainedOptimizer(optimizer, store, barrier, payload, rollback_window=manual, settings=settings)
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return RetainedZeRO1(optimizer, store, split, barrier, payload, settings=settings)


def stepped_optimizer(ro: RetainedOptimizer) -> torch.optim.Optimizer:
    """The optimizer Lightning steps: the ZeroRedundancyOptimizer, or the bound one itself."""
    return ro.zero if isinstance(ro, RetainedZeRO1) else ro.optimizer


def after_adopt(ro: RetainedOptimizer) -> None:
    """Resuming: the owners' retained params are the truth; refresh every replica from them."""
    if isinstance(ro, RetainedZeRO1):
        ro.refresh_replicas()


def before_free(ro: RetainedOptimizer) -> None:
    """The store is being freed: ZeRO's own step and zero_grad come back."""
    if isinstance(ro, RetainedZeRO1):
        ro.unbind()
