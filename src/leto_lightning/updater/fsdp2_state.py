"""What ``torch.distributed.checkpoint`` (DCP) sees of a bound FSDP2 model and optimizer.

After binding (``updater.fsdp2``) the optimizer looks as it does under plain FSDP2: its param
groups hold the model's DTensor parameters, and ``optimizer.state[param]`` holds ``step`` and
DTensor *views* of the retained state (the shard's real rows; the padding rows stay in the
store). So ``optimizer.state_dict()``, ``get_state_dict`` / ``get_optimizer_state_dict``
(keyed by FQN) and ``dcp.save`` work unchanged and read from retained memory. The chunk
transactions keep updating the padded shards through their own aliases
(``RetainedOptimizer.params``), which the optimizer's users never see.

Loading writes into the same memory: ``dcp.load`` into a ``get_state_dict`` dict fills the
views in place; ``model.load_state_dict`` copies into the DTensor parameters (views), and
``optimizer.load_state_dict`` (so ``set_state_dict`` / ``set_optimizer_state_dict``) copies
each loaded value into its view. Either way the retained pages changed behind the chunk
transactions, so the store is *initialised again* from them, as a new store is: checksums,
tier-1 parity, the node's tier-2 stripes (a collective: every rank of the node loads), every
chunk's version and the progress record, committed at ``iteration - 1`` with a payload.
Inside ``RetainedShardState.restoring()`` the store is marked incomplete for the whole load
(a crash meanwhile leaves nothing recovery would trust) and initialised once at its end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import ConfigurationError, UsageError
from ..faults.points import point
from ..retained.layout import GRAD, PARAM, ParamSlot
from ..retained.torch_internals import fsdp_param_sharded_data
from .retained_optimizer import RetainedOptimizer
from .store_setup import complete_new_store, encode_all

log = logging.getLogger(__name__)


@dataclass
class Restore:
    """Where a restored store continues (set it inside ``restoring()``, e.g. once the
    checkpoint's metadata is read): the first iteration the next step runs, and the payload
    recorded with the committed ``iteration - 1``. ``iteration=None``: Adam's loaded ``step``
    (one optimizer step per iteration), else the store's current iteration."""

    iteration: int | None = None
    payload: object = None


class RetainedShardState:
    """The DCP-facing state of one rank's bound FSDP2 shards (module doc)."""

    def __init__(self, ro: RetainedOptimizer, sharded: Sequence[tuple[torch.nn.Parameter, Any]],
                 rows: Sequence[int]) -> None:
        self.ro, self.store, self.optimizer = ro, ro.store, ro.optimizer
        self._sharded = list(sharded)  # (DTensor param, FSDPParam), in the optimizer's order
        self._rows = list(rows)  # real rows of dim 0 of each local shard
        lay = ro.layout
        self._kinds = [tuple(k for k in lay.segments[s.segment].kinds if k not in (PARAM, GRAD)) for s in lay.params]
        self._pieces = [self._pieces_of(s) for s in lay.params]
        self._exposed: list[dict[str, torch.Tensor]] = []
        self._restore: Restore | None = None  # inside restoring(): initialised once at its end
        self.read_only = ""  # why loads are refused: a shadow's views until it resumes, or detached

    def _pieces_of(self, slot: ParamSlot) -> list[int]:
        lay = self.ro.layout
        return [i for c, ps in enumerate(lay.chunk_pieces) for i, pc in enumerate(ps, lay.chunk_first_piece[c])
                if pc[0] == slot.index]

    @property
    def current(self) -> Restore | None:
        """The restore in progress (inside ``restoring()``), else None."""
        return self._restore

    # -- what the optimizer shows ---------------------------------------------------------
    def expose(self) -> None:
        """Param groups hold the DTensor params again; ``optimizer.state`` is keyed by them and
        holds DTensor views of the retained state (``RetainedOptimizer.bind`` keyed it by the
        padded aliases)."""
        it = iter(self._sharded)
        for group in self.optimizer.param_groups:
            group["params"] = [next(it)[0] for _ in group["params"]]
        state = self.optimizer.state
        for alias, (param, fsdp_param), rows in zip(self.ro.params, self._sharded, self._rows):
            bound = state.pop(alias, {})
            shown = {k: (v if k == "step" else fsdp_param.to_sharded_dtensor(v.narrow(0, 0, rows)))
                     for k, v in bound.items()}
            state[param] = shown
            self._exposed.append(shown)

    # -- loading --------------------------------------------------------------------------
    def load_optimizer_state(self, state_dict: Mapping[str, Any]) -> None:
        """``optimizer.load_state_dict``: every value checked against this rank's shard first,
        then torch checks the groups and takes their settings, and each value is copied into its
        retained view (the views stay the optimizer's state, whatever happens)."""
        self._writable("optimizer.load_state_dict")
        if self._restore is None:
            self.store.clear_complete()  # partly loaded until initialised: nothing recovery trusts
        self._check_shapes(state_dict)
        try:
            type(self.optimizer).load_state_dict(self.optimizer, dict(state_dict))  # the class's, not ours
            loaded = dict(self.optimizer.state)
            with torch.no_grad():
                for i, (param, _) in enumerate(self._sharded):
                    self._copy_in(i, loaded.get(param, {}))
        finally:
            for (param, _), shown in zip(self._sharded, self._exposed):
                self.optimizer.state[param] = shown
        self.values_changed()

    def _check_shapes(self, state_dict: Mapping[str, Any]) -> None:
        """Loaded values pair with params by position (as torch pairs them)."""
        ids = [pid for group in state_dict.get("param_groups", ()) for pid in group.get("params", ())]
        if len(ids) != len(self._sharded):
            return  # torch refuses it, naming the groups
        for i, pid in enumerate(ids):
            values = state_dict.get("state", {}).get(pid, {})
            slot, rows = self.ro.layout.params[i], self._rows[i]
            for kind in self._kinds[i]:
                value = values.get(kind)
                local = value.to_local() if isinstance(value, DTensor) else value
                if local is not None and tuple(local.shape) != (rows, *slot.shape[1:]):
                    raise ConfigurationError(
                        f"param {slot.name}: loaded optimizer state {kind!r} has local shape {tuple(local.shape)}, "
                        f"this rank's shard {(rows, *slot.shape[1:])}: load sharded state (DTensors, e.g. through "
                        "torch.distributed.checkpoint's get_state_dict / set_state_dict)")

    def _copy_in(self, i: int, values: Mapping[str, Any]) -> None:
        slot = self.ro.layout.params[i]
        for kind in self._kinds[i]:
            view = self.store.param_view(slot, kind).narrow(0, 0, self._rows[i])
            value = values.get(kind)
            if value is None:  # torch creates it at the first step: zeros until then
                view.zero_()
            else:
                view.copy_(value.to_local() if isinstance(value, DTensor) else value)
        if self.ro.layout.family == "adam":
            step = values.get("step")
            self.store.steps[self._pieces[i]] = float(step) if step is not None else 0.0
        else:  # SGD keeps no step: a loaded momentum buffer means "not the first step"
            self.store.steps[self._pieces[i]] = 1.0 if values.get("momentum_buffer") is not None else 0.0

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise UsageError(f"{what}: {self.read_only}")

    def model_loading(self, module: torch.nn.Module, *args: object) -> None:
        """The root model's ``load_state_dict`` pre-hook: refused on a shadow's views; else the
        store is incomplete from before the first parameter is written."""
        self._writable("model.load_state_dict")
        if self._restore is None:
            self.store.clear_complete()

    def model_loaded(self, module: torch.nn.Module, incompatible_keys: object) -> None:
        """The root model's ``load_state_dict`` post-hook: the parameters were copied into
        their retained views (in place); anything that replaced a shard instead is refused."""
        for slot, (param, fsdp_param) in zip(self.ro.layout.params, self._sharded):
            view = self.store.param_view(slot, PARAM)
            shard = fsdp_param_sharded_data(fsdp_param)
            if fsdp_param.sharded_param is not param or shard.data_ptr() != view.data_ptr():
                self.store.clear_complete()
                raise UsageError(f"param {slot.name}: load_state_dict replaced the retained shard instead of copying "
                                 "into it (assign=True?): load with assign=False, the default, after binding")
        self.values_changed()

    def values_changed(self) -> None:
        """Loaded values are in the views: initialise the store from them now, or at the end of
        ``restoring()``."""
        if self._restore is None:
            self.store.clear_complete()
            self.initialise(Restore())

    @contextmanager
    def restoring(self, iteration: int | None = None, payload: object = None) -> Iterator[Restore]:
        """Load a checkpoint inside this block (``dcp.load`` + ``set_state_dict``, Lightning's or
        Accelerate's loaders): the store is incomplete until the block ends, then initialised
        once from the loaded values; the yielded ``Restore`` says where it continues. An
        exception leaves it incomplete (resume from the checkpoint again)."""
        self._writable("restoring()")
        if self._restore is not None:
            raise UsageError("restoring() inside restoring(): load one checkpoint at a time")
        self.store.clear_complete()
        self._restore = Restore(iteration, payload)
        try:
            yield self._restore
            restore = self._restore
        finally:
            self._restore = None
        point("restore.loaded", rank=self.store.spec.rank)  # loaded, not yet protected: still incomplete
        self.initialise(restore)

    def initialise(self, restore: Restore) -> None:
        """As a new store is set up (``RetainedOptimizer.bind(adopt=False)``), from the values
        in the views: zero gradients, every chunk at the iteration, all parity encoded, the
        progress record committed at ``iteration - 1``; then marked complete."""
        ro, store = self.ro, self.store
        iteration = restore.iteration if restore.iteration is not None else self._loaded_iteration()
        if iteration < 0:
            raise ConfigurationError(f"iteration {iteration}: a restored store continues at an iteration >= 0")
        ro.zero_grad()
        store.chunk_table[:, 0] = iteration
        encode_all(store, ro.txn.codes)
        ro.txn.commit(iteration - 1, restore.payload)
        ro.iteration, ro.boundary_payload = iteration, restore.payload
        complete_new_store(store, ro.barrier)
        log.info("rank %d: retained FSDP2 shards initialised from loaded state at iteration %d",
                 store.spec.rank, iteration)

    def _loaded_iteration(self) -> int:
        if self.ro.layout.family != "adam" or not self.store.steps.numel():
            return self.ro.iteration
        return int(self.store.steps.max().item())


def detached_copy(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with every tensor a detached copy (a DTensor's
    local tensor then starts its own storage)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: detached_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(detached_copy(v) for v in value)
    return value
