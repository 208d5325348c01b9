"""Bind a ``ZeroRedundancyOptimizer`` (ZeRO-1 over DDP) to retained memory.

ZeRO-1 partitions the optimizer's parameters across ranks by whole parameters; ``zero.optim``
is a plain torch optimizer over the ones this rank *owns*. A step updates the owned params
(``zero.optim.step()``), then every owner broadcasts its params to the other ranks.

What the rank's store holds: the params it owns (fp32), their gradients and their optimizer
state -- the layout of ``retained.owned``. The replicas of the params other ranks own stay in
ordinary memory, on purpose: ZeRO-1 exists so that a rank does not hold the optimizer state of
what it does not own, and retaining the replicas would add two full copies of the model per
rank (params and grads, plus their parity) for values that exist, retained, on their owners.
They could not be protected cheaply either: the broadcast rewrites them outside any chunk
transaction. So after a recovery the owners' retained params are the truth, and
``refresh_replicas`` (a broadcast from each owner) rebuilds every rank's replicas before the
first forward. That also covers a crash between an owner's commit and its broadcast, which
leaves its peers' replicas one step behind.

The step, ``zero.step()`` as before: ZeRO syncs the param groups' settings (an LR schedule)
into ``zero.optim``, whose ``step`` is the binding's: chunk transactions over the owned shard
(``RetainedOptimizer``); then ZeRO's own broadcast. ``zero.zero_grad`` zeroes the retained
gradients in place. Refused (``check_zero1``): ``parameters_as_bucket_view=True`` (it
re-points every param into ZeRO's flat buckets) and ``overlap_with_ddp=True`` (the local
step runs inside DDP's communication hook).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..env import ProcessSettings
from ..errors import ConfigurationError, UsageError
from ..faults.points import point
from ..retained.config import RetainedConfig
from ..retained.layout import StoreLayout
from ..retained.owned import OwnedParam, owned_layout
from ..retained.store import RetainedStore, StoreSpec
from ..retained.torch_internals import zero_overlaps_with_ddp
from .retained_optimizer import (
    RetainedOptimizer,
    config_for,
    hyperparameters,
    optimizer_family,
)
from .store_setup import set_up_store

__all__ = ["Partition", "RetainedZeRO1", "attach_zero1", "check_zero1", "create_zero1", "partition",
           "zero1_layout"]

COMMITTED_POINT = "zero1.committed"  # after the owned shard's commit, before ZeRO's broadcast


def check_zero1(zero: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """Refuse a ZeRO-1 optimizer whose params or step cannot live in retained memory."""
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise ConfigurationError(f"{type(zero).__name__} is not a torch.distributed.optim.ZeroRedundancyOptimizer")
    if zero.parameters_as_bucket_view:
        raise ConfigurationError("ZeroRedundancyOptimizer(parameters_as_bucket_view=True) re-points every parameter "
                                 "into ZeRO's flat buckets, out of retained memory: construct it with "
                                 "parameters_as_bucket_view=False (the default)")
    if zero_overlaps_with_ddp(zero):
        raise ConfigurationError("ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's communication "
                                 "hook, outside the retained transactions: construct it with overlap_with_ddp=False "
                                 "(the default) and call optimizer.step()")
    if optimizer_family(zero.optim) == "generic":
        raise ConfigurationError(f"ZeroRedundancyOptimizer over {type(zero.optim).__name__}: retained ZeRO-1 state "
                                 "supports optimizer_class=torch.optim.SGD, Adam and AdamW for now")
    if any(zero.optim.state.values()):
        raise UsageError("bind the ZeroRedundancyOptimizer to retained memory before its first step (its state must "
                         "still be empty)")
    return zero


class Partition:
    """Who owns which parameter: every rank's share (from each rank's ``zero.optim``)."""

    def __init__(self, zero: ZeroRedundancyOptimizer, names: dict[torch.nn.Parameter, str] | None = None) -> None:
        self.params: list[torch.nn.Parameter] = [p for g in zero.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(self.params)}
        mine = [[index[p] for p in g["params"]] for g in zero.optim.param_groups]
        shares: list[Any] = [None] * zero.world_size
        dist.all_gather_object(shares, mine, group=zero.process_group)
        self.shares: list[list[list[int]]] = shares  # shares[rank][group] = indices into self.params
        self.owner = {i: r for r, groups in enumerate(shares) for g in groups for i in g}
        names = names or {}
        self.named: list[list[list[OwnedParam]]] = [
            [[(names.get(self.params[i], f"param{i}"), tuple(self.params[i].shape)) for i in g] for g in groups]
            for groups in shares]


def partition(zero: ZeroRedundancyOptimizer, names: dict[torch.nn.Parameter, str] | None = None) -> Partition:
    """The partition of ``zero``'s params (a collective: every rank calls it)."""
    return Partition(zero, names)


def zero1_layout(zero: ZeroRedundancyOptimizer, split: Partition, config: RetainedConfig) -> StoreLayout:
    """This rank's store layout: its owned params, regions equal on every rank (tier 2)."""
    dtypes = {p.dtype for p in split.params}
    if len(dtypes) != 1:
        raise ConfigurationError(f"params of dtypes {sorted(str(d) for d in dtypes)}: ZeroRedundancyOptimizer "
                                 "needs one dense dtype")
    return owned_layout(split.named, zero.rank, dtype=dtypes.pop(), family=optimizer_family(zero.optim),
                        group_options=hyperparameters(zero.optim), page_bytes=config.page_bytes,
                        chunk_pages=config.chunk_pages)


class RetainedZeRO1(RetainedOptimizer):
    """``RetainedOptimizer`` over ``zero.optim`` (the owned params), plus the ZeRO-1 glue:
    ``zero.optim.step`` runs the transactions, ``zero.zero_grad`` keeps the retained gradients
    views, and ``refresh_replicas`` rebuilds the non-owned params from their owners."""

    def __init__(self, zero: ZeroRedundancyOptimizer, store: RetainedStore, split: Partition,
                 barrier: Callable[[], None] | None = None, payload_fn: Callable[[], object] | None = None,
                 settings: ProcessSettings | None = None) -> None:
        super().__init__(check_zero1(zero).optim, store, barrier, payload_fn, settings=settings)
        self.zero = zero
        self.split = split
        owned = set(map(id, self.params))
        self._replicas = [p for p in split.params if id(p) not in owned]
        # Bound methods on the instances (an LR scheduler wraps zero.step, which stays ZeRO's own).
        zero.optim._leto_zero1 = self  # zero.optim is typed Any
        zero.optim.step = types.MethodType(_owned_step, zero.optim)
        zero.zero_grad = types.MethodType(_zero_grad, zero)  # type: ignore[method-assign]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """ZeRO's step: settings synced, the owned shard's transactions, the owners' broadcast."""
        return self.zero.step(closure) if closure is not None else self.zero.step()

    def owned_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``zero.optim.step``: the chunk transactions over the owned params."""
        loss = RetainedOptimizer.step(self, closure)
        point(COMMITTED_POINT, iteration=self.iteration - 1, rank=self.store.spec.rank)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The owned gradients zeroed in place (retained views); the replicas' as torch does."""
        super().zero_grad(set_to_none)
        for p in self._replicas:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def unbind(self) -> None:
        """Give ``zero.optim.step`` and ``zero.zero_grad`` back to torch (the retained memory is
        being freed; the caller copied params and state out)."""
        self.zero.optim.__dict__.pop("step", None)
        self.zero.__dict__.pop("zero_grad", None)

    def refresh_replicas(self) -> None:
        """Every rank's copy of every param becomes its owner's retained value (a collective:
        one broadcast per param from its owner). Run after a recovery, before the first forward."""
        group = self.zero.process_group
        handles = []
        with torch.no_grad():
            for i, p in enumerate(self.split.params):
                src = dist.get_global_rank(group, self.split.owner[i])
                handles.append(dist.broadcast(p.data, src=src, group=group, async_op=True))
        for handle in handles:
            if handle is not None:
                handle.wait()


def _owned_step(optim: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    return optim._leto_zero1.owned_step(closure)  # type: ignore[attr-defined]


def _zero_grad(zero: ZeroRedundancyOptimizer, set_to_none: bool = True) -> None:
    zero.optim._leto_zero1.zero_grad(set_to_none)


def create_zero1(zero: ZeroRedundancyOptimizer, config: RetainedConfig, *, job_id: str, local_rank: int = 0,
                 n_local: int = 1, node: int = 0, barrier: Callable[[], None] | None = None,
                 payload_fn: Callable[[], object] | None = None,
                 names: dict[torch.nn.Parameter, str] | None = None,
                 settings: ProcessSettings | None = None) -> RetainedZeRO1:
    """A new store for this rank's owned params, bound, encoded (tier 2 across the node's ranks)
    and marked complete. Call it on every rank after the DDP wrap (every rank holds the same
    params then); ``barrier`` spans every rank (tier-2 set-up and each step's agreement);
    ``settings``: ``ProcessSettings.from_env()`` where the caller reads the environment."""
    check_zero1(zero)
    config = config_for(config, zero)
    config.check_devices(n_local)
    split = partition(zero, names)
    layout = zero1_layout(zero, split, config)
    rank = dist.get_global_rank(zero.process_group, zero.rank)
    spec = StoreSpec(job_id, rank, node, local_rank, n_local, layout, config)

    def bind(store: RetainedStore) -> RetainedZeRO1:
        bound = RetainedZeRO1(zero, store, split, barrier, payload_fn, settings=settings)
        bound.bind(adopt=False)
        return bound

    return set_up_store(spec, bind, barrier=barrier, settings=settings, attach_with="attach_zero1")


def attach_zero1(zero: ZeroRedundancyOptimizer, *, job_id: str, barrier: Callable[[], None] | None = None,
                 payload_fn: Callable[[], object] | None = None,
                 names: dict[torch.nn.Parameter, str] | None = None, resume: bool = True,
                 settings: ProcessSettings | None = None) -> RetainedZeRO1:
    """This rank's existing store (recovered, e.g. by ``updater.recovery.recover_node``): the
    owned params, grads and optimizer state take its values, every replica is refreshed from
    its owner, and training continues after the last committed iteration (``.iteration``).
    ``resume=False``: the caller calls ``resume()`` itself (an integration that does so for
    every binding)."""
    check_zero1(zero)
    split = partition(zero, names)
    rank = dist.get_global_rank(zero.process_group, zero.rank)
    store = RetainedStore.attach(job_id, rank)
    expected = zero1_layout(zero, split, store.spec.config)
    if expected != store.layout:
        store.close()
        raise ConfigurationError(f"rank {rank}: the params this rank owns ({expected.describe()}) do not match the "
                                 f"retained store of job {job_id!r} ({store.layout.describe()}): same model, "
                                 "optimizer, world size and RetainedConfig as the job that created it")
    bound = RetainedZeRO1(zero, store, split, barrier, payload_fn, settings=settings)
    bound.bind(adopt=True, resume=resume)
    bound.refresh_replicas()
    # The retained gradients are the last committed iteration's: the next one accumulates from zero.
    bound.zero_grad()
    return bound
