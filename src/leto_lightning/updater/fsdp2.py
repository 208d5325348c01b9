"""Bind a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) to retained memory.

FSDP2 keeps, per parameter, an ``FSDPParam`` whose ``_sharded_param_data`` is this rank's
*padded* local shard (flat) and whose ``sharded_param`` (a DTensor, the ``nn.Parameter`` the
optimizer sees) has ``_local_tensor``, a view of its real rows. Every forward all-gathers from
``_sharded_param_data``; the reduce-scatter adds each step's gradient in place into an existing
``sharded_param.grad`` (a DTensor). So pointing those three at retained views keeps the shard's
params (the fp32 master copy), grads and optimizer state in the rank's store, and after a
roll-forward nothing needs rebuilding: the next forward gathers from the retained shards.

``RetainedOptimizer`` binds one plain *alias* parameter per ``FSDPParam``, shaped like the
padded local shard (``retained.shards``), and runs the update as chunk transactions over local
memory only. The optimizer itself then looks as under plain FSDP2 again (``updater.fsdp2_state``):
its param groups hold the DTensor parameters and its state DTensor views of the retained state,
so ``torch.distributed.checkpoint`` saves and loads from retained memory. An LR scheduler built
on the optimizer keeps working. Gradient clipping with
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` runs on the DTensor gradients, which
are views of the retained gradients, before ``step()`` (prepare).

This touches private torch attributes (listed in ``PRIVATE_ATTRIBUTES``): it runs only on the
torch versions in ``SUPPORTED_TORCH`` and fails naming the attribute when one is missing.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..env import ProcessSettings
from ..errors import ConfigurationError, UsageError
from ..retained.config import RetainedConfig
from ..retained.layout import GRAD, PARAM, ParamSlot
from ..retained.shards import LocalShard, shard_layout
from ..retained.store import RetainedStore, StoreSpec
from ..retained.torch_internals import mark_optimizer_stepped, mark_wrapped_by_lr_scheduler
from .fsdp2_state import Restore, RetainedShardState, detached_copy
from .retained_optimizer import (
    RetainedOptimizer,
    config_for,
    hyperparameters,
    optimizer_family,
)
from .store_setup import set_up_store

SUPPORTED_TORCH = ((2, 13), (2, 14))  # [low, high): the versions whose FSDP2 internals this was tested on
# (owner, attribute): what this module reads or re-points.
PRIVATE_ATTRIBUTES = (
    ("FSDPModule", "_get_fsdp_state"),
    ("FSDPState", "_fsdp_param_groups"),
    ("FSDPParamGroup", "fsdp_params"),
    ("FSDPParam", "sharded_param"),
    ("FSDPParam", "_sharded_param_data"),
    ("FSDPParam", "padded_sharded_param_size"),
    ("FSDPParam", "sharded_size"),
    ("FSDPParam", "fsdp_placement"),
    ("FSDPParam", "to_sharded_dtensor"),
    ("DTensor", "_local_tensor"),
)


SHADOW_VIEWS = ("this rank's retained shards are a shadow's views of the active trainer's memory "
                "(attach_fsdp2(resume=False)): load checkpoints in the active trainer, or after RetainedFSDP2.resume()")


class FSDP2InternalsError(ConfigurationError):
    """This torch's FSDP2 does not have the private attributes the retained binding uses."""


def check_torch_version(version: str | None = None) -> None:
    """Refuse torch versions whose FSDP2 internals were not tested (``SUPPORTED_TORCH``)."""
    version = version or torch.__version__
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    if not (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor):
        raise FSDP2InternalsError(
            f"torch {version}: retained FSDP2 state is tested on torch >={lo_major}.{lo_minor},"
            f"<{hi_major}.{hi_minor} (it re-points private FSDP2 attributes); install a torch in that range")


def private(obj: object, name: str) -> Any:
    """``getattr(obj, name)``, or an error naming the attribute that moved."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise FSDP2InternalsError(
            f"torch {torch.__version__}: {type(obj).__name__}.{name} is missing: FSDP2's internals moved, and the "
            f"retained binding (leto_lightning.updater.fsdp2) must be adapted to this torch") from None


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a submodule) is sharded with ``fully_shard``."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_params(model: torch.nn.Module) -> dict[torch.nn.Parameter, Any]:
    """Every FSDP2 sharded parameter of ``model`` -> its ``FSDPParam``."""
    found: dict[torch.nn.Parameter, Any] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = private(module, "_get_fsdp_state")()
        for group in private(state, "_fsdp_param_groups") or ():
            for fsdp_param in private(group, "fsdp_params"):
                found[private(fsdp_param, "sharded_param")] = fsdp_param
    return found


def local_shard(fsdp_param: Any, name: str) -> LocalShard:
    """What this rank holds of one parameter: ``Shard(0)`` on a 1-D mesh (plain ``fully_shard``),
    or HSDP's ``(Replicate(), Shard(0))`` on a 2-D (replicate, shard) mesh."""
    placement = private(fsdp_param, "fsdp_placement")
    param = private(fsdp_param, "sharded_param")
    if not isinstance(placement, Shard) or placement.dim != 0 or replica_shard_count(param) is None:
        raise ConfigurationError(f"param {name}: placements {tuple(param.placements)} on a {param.device_mesh.ndim}-D "
                                 "mesh; retained FSDP2 state supports Shard(0) on a 1-D mesh (fully_shard) and "
                                 "(Replicate(), Shard(0)) on a 2-D one (HSDP)")
    padded = tuple(private(fsdp_param, "padded_sharded_param_size"))
    sharded = tuple(private(fsdp_param, "sharded_size"))
    flat = private(fsdp_param, "_sharded_param_data")
    if flat.numel() != LocalShard(name, tuple(param.shape), padded, sharded[0], param.dtype).padded_numel:
        raise FSDP2InternalsError(f"param {name}: FSDPParam._sharded_param_data has {flat.numel()} elements, "
                                  f"the padded shard {padded}: FSDP2's internals changed")
    return LocalShard(name, tuple(param.shape), padded, sharded[0], param.dtype)


def replica_shard_count(param: DTensor) -> int | None:
    """How a sharded parameter is replicated (``StoreSpec.replica_shards``): 0 on a 1-D mesh (no
    replicas), the shard dimension's size S under HSDP -- ``init_device_mesh``'s (R, S) mesh puts
    rank ``r * S + s`` in replica group r holding shard s, so rank g holds shard g % S; None for
    any other placement."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim == 1 and placements == (Shard(0),):
        return 0
    if mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        shards = mesh.size(1)
        return shards if mesh.get_local_rank(1) == mesh.get_rank() % shards else 0  # another layout: no claim
    return None


class RetainedFSDP2:
    """An FSDP2 model's local shards and their optimizer, bound to one rank's retained store.

    The optimizer's ``step``, ``zero_grad`` and ``load_state_dict`` become this object's
    (instance attributes, so the training loop stays as it was): a step is a chunk transaction,
    zeroing keeps every gradient a retained view, loading copies into the retained views.
    Build LR schedulers after binding (they wrap ``step``)."""

    def __init__(self, model: torch.nn.Module, ro: RetainedOptimizer,
                 sharded: Sequence[tuple[torch.nn.Parameter, Any]]) -> None:
        self.model = model
        self.ro = ro
        self.optimizer = ro.optimizer
        self.store = ro.store
        self._sharded = list(sharded)  # (DTensor param, FSDPParam), in the optimizer's order
        self._grad_views = [self._real_rows(slot, GRAD) for slot in ro.layout.params]
        self._repoint()
        self.state = RetainedShardState(ro, self._sharded, [v.shape[0] for v in self._grad_views])
        self.state.expose()
        self._load_hooks = (model.register_load_state_dict_pre_hook(self.state.model_loading),
                            model.register_load_state_dict_post_hook(self.state.model_loaded))
        # Methods bound to the optimizer (an LR scheduler re-binds the step it wraps to it).
        opt = self.optimizer
        opt._leto_fsdp2 = self  # type: ignore[attr-defined]
        opt.step = types.MethodType(_optimizer_step, opt)  # type: ignore[method-assign]
        opt.zero_grad = types.MethodType(_optimizer_zero_grad, opt)  # type: ignore[method-assign]
        opt.load_state_dict = types.MethodType(_optimizer_load_state_dict, opt)  # type: ignore[method-assign]

    def _real_rows(self, slot: ParamSlot, kind: str) -> torch.Tensor:
        fsdp_param = self._sharded[slot.index][1]
        view = self.store.param_view(slot, kind)
        return view.narrow(0, 0, private(fsdp_param, "sharded_size")[0])

    def _repoint(self) -> None:
        for slot, (param, fsdp_param) in zip(self.ro.layout.params, self._sharded):
            view = self.store.param_view(slot, PARAM)
            fsdp_param._sharded_param_data = view.view(-1)  # what every forward all-gathers
            # the DTensor parameter's local rows (typed as nn.Parameter, it is a DTensor)
            param._local_tensor = view.narrow(0, 0, private(fsdp_param, "sharded_size")[0])  # type: ignore[attr-defined]
            param.grad = fsdp_param.to_sharded_dtensor(self._grad_views[slot.index])
            param.register_post_accumulate_grad_hook(self._received(slot.index))

    def _received(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self.ro.mark_received(index)
        return hook

    @property
    def iteration(self) -> int:
        return self.ro.iteration

    def resume(self) -> object:
        """Once promoted (after ``attach_fsdp2(..., resume=False)``): continue after the last
        committed iteration with zeroed gradients. Returns the committed resume payload."""
        payload = self.ro.resume()
        self.state.read_only = ""
        self.zero_grad()
        return payload

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the retained gradients in place; DTensor gradients something replaced (e.g.
        ``model.zero_grad()``) point at their retained views again."""
        self.ro.zero_grad(set_to_none)
        for (param, fsdp_param), view in zip(self._sharded, self._grad_views):
            if not isinstance(param.grad, DTensor) or param.grad._local_tensor.data_ptr() != view.data_ptr():
                param.grad = fsdp_param.to_sharded_dtensor(view)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The update of this rank's shards as chunk transactions (after clipping)."""
        loss = closure() if closure is not None else None
        for i, ((param, fsdp_param), view) in enumerate(zip(self._sharded, self._grad_views)):
            grad = param.grad
            if grad is None:
                continue  # no gradient: skipped, as torch.optim skips it
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            if local.data_ptr() != view.data_ptr():  # a new gradient tensor: bring it in
                view.copy_(local)
                param.grad = fsdp_param.to_sharded_dtensor(view)
                self.ro.mark_received(i)
        self.ro.step()
        return loss

    def record_committed(self, payload: object) -> None:
        self.ro.record_committed(payload)

    def detach(self) -> None:
        """Copy the shards, their gradients and the optimizer state out of retained memory
        (the model and optimizer stay usable: ``trainer.test()``, ``state_dict()``) before the
        store is closed or freed; the optimizer's ``step``/``zero_grad`` are its class's again."""
        with torch.no_grad():
            for alias, (param, fsdp_param), grad in zip(self.ro.params, self._sharded, self._grad_views):
                data = alias.data.clone()
                alias.data = data
                fsdp_param._sharded_param_data = data.view(-1)
                param._local_tensor = data.narrow(0, 0, private(fsdp_param, "sharded_size")[0])  # type: ignore[attr-defined]
                param.grad = fsdp_param.to_sharded_dtensor(grad.clone())
                alias.grad = None
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.clone()
        for name in ("step", "zero_grad", "load_state_dict", "_leto_fsdp2"):
            self.optimizer.__dict__.pop(name, None)
        for handle in self._load_hooks:  # loads go to the copies now, never to the store
            handle.remove()
        self.state.read_only = "detached from retained memory (RetainedFSDP2.detach()): nothing to restore into"

    # -- distributed checkpoints (torch.distributed.checkpoint) ---------------------------
    def state_dict(self, copy: bool = False) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` as ``get_state_dict(model, optimizer)`` returns it
        (DTensors keyed by FQN): views of retained memory, what ``dcp.save`` takes.
        ``copy=True``: detached copies, e.g. to ``torch.save`` per rank (torch cannot pickle a
        DTensor whose local tensor is a view at an offset, and a view would pickle its whole
        retained segment)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        return detached_copy(state) if copy else state

    def load_state_dict(self, state_dict: Mapping[str, Any], *, iteration: int | None = None,
                        payload: object = None) -> None:
        """Load a ``state_dict()``-shaped dict (e.g. filled by ``dcp.load``) into retained memory
        and initialise the store from it (``Restore`` says what ``iteration`` defaults to)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with self.restoring(iteration, payload):
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])

    def save_checkpoint(self, checkpoint_id: str) -> None:
        """``dcp.save`` of ``state_dict()``: a directory plain FSDP2 + the same optimizer loads."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=checkpoint_id)

    def load_checkpoint(self, checkpoint_id: str, *, iteration: int | None = None, payload: object = None) -> None:
        """``dcp.load`` straight into the retained views, then the store initialised from them
        (a checkpoint of plain FSDP2 with the same model and optimizer loads too)."""
        import torch.distributed.checkpoint as dcp

        with self.restoring(iteration, payload):
            state = self.state_dict()
            dcp.load(state, checkpoint_id=checkpoint_id)
            self.load_state_dict(state)

    @contextmanager
    def restoring(self, iteration: int | None = None, payload: object = None) -> Iterator[Restore]:
        """The block a checkpoint is loaded in (e.g. around Lightning's or Accelerate's loader):
        the store is incomplete until it ends, then initialised once (``RetainedShardState``);
        nested calls (``load_state_dict`` inside) join the outer block, setting what they name."""
        current = self.state.current
        if current is not None:
            if iteration is not None:
                current.iteration = iteration
            if payload is not None:
                current.payload = payload
            yield current
            return
        with self.state.restoring(iteration, payload) as restore:
            yield restore


def _optimizer_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    mark_optimizer_stepped(optimizer)  # what torch's LR-scheduler step wrapper records
    return optimizer._leto_fsdp2.step(closure)  # type: ignore[attr-defined]


# An LR scheduler built before binding checks its wrapper is still there (else it warns that
# optimizer.step was overridden); one built after then leaves the step as it is (it records the
# call itself, above).
mark_wrapped_by_lr_scheduler(_optimizer_step)


def _optimizer_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    optimizer._leto_fsdp2.zero_grad(set_to_none)  # type: ignore[attr-defined]


def _optimizer_load_state_dict(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    optimizer._leto_fsdp2.state.load_optimizer_state(state_dict)  # type: ignore[attr-defined]


def _bindable(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              ) -> tuple[list[list[LocalShard]], list[tuple[torch.nn.Parameter, Any]], list[list[torch.nn.Parameter]]]:
    """The local shards per param group, (DTensor param, FSDPParam) in the optimizer's order, and
    per group the padded aliases the chunk transactions update (refusals change nothing)."""
    check_torch_version()
    if optimizer_family(optimizer) == "generic":
        raise ConfigurationError(f"{type(optimizer).__name__}: retained FSDP2 state supports torch.optim.SGD, Adam "
                                 "and AdamW for now")
    if any(optimizer.state.values()):
        raise UsageError("bind FSDP2 shards to retained memory before the optimizer's first step (its state must "
                         "still be empty); load a checkpoint after binding: it loads into retained memory")
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigurationError("the model is wrapped in FullyShardedDataParallel (FSDP1, e.g. Lightning's "
                                 "strategy='fsdp'): retained sharded state needs FSDP2; shard with "
                                 "torch.distributed.fsdp.fully_shard instead")
    by_param, names = fsdp_params(model), {p: n for n, p in model.named_parameters()}
    shards: list[list[LocalShard]] = []
    sharded: list[tuple[torch.nn.Parameter, Any]] = []
    aliased: list[list[torch.nn.Parameter]] = []
    for group in optimizer.param_groups:
        members, aliases = [], []
        for p in group["params"]:
            if p not in by_param:
                raise ConfigurationError(f"param {names.get(p, '?')} of the optimizer is not sharded by fully_shard: "
                                         "shard every module whose parameters the optimizer updates")
            shard = local_shard(by_param[p], names.get(p, "?"))
            members.append(shard)
            sharded.append((p, by_param[p]))
            flat = private(by_param[p], "_sharded_param_data")
            aliases.append(torch.nn.Parameter(flat.view(shard.padded_shape), requires_grad=p.requires_grad))
        shards.append(members)
        aliased.append(aliases)
    return shards, sharded, aliased


def _bind_store(model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: RetainedStore,
                binding: tuple[list[tuple[torch.nn.Parameter, Any]], list[list[torch.nn.Parameter]]],
                barrier: Callable[[], None] | None, payload_fn: Callable[[], object] | None,
                adopt: bool, resume: bool = True, settings: ProcessSettings | None = None) -> RetainedFSDP2:
    """``RetainedOptimizer`` over the padded aliases, bound; then the optimizer shows the DTensor
    params again (``RetainedFSDP2``). A failure leaves the param groups as they were."""
    sharded, aliased = binding
    originals = [group["params"] for group in optimizer.param_groups]
    for group, aliases in zip(optimizer.param_groups, aliased):  # only once every param is known good
        group["params"] = aliases
    try:
        ro = RetainedOptimizer(optimizer, store, barrier, payload_fn, settings=settings)
        ro.bind(adopt=adopt, resume=resume)
        return RetainedFSDP2(model, ro, sharded)
    except BaseException:
        for group, params in zip(optimizer.param_groups, originals):
            group["params"] = params
        for alias in (a for aliases in aliased for a in aliases):
            optimizer.state.pop(alias, None)
        raise


def create_fsdp2(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RetainedConfig, *, job_id: str,
                 rank: int, node: int = 0, local_rank: int = 0, n_local: int = 1,
                 barrier: Callable[[], None] | None = None, payload_fn: Callable[[], object] | None = None,
                 settings: ProcessSettings | None = None) -> RetainedFSDP2:
    """A new store for this rank's local shards, bound, encoded (tier 2 across the node's ranks)
    and marked complete. ``barrier`` spans every rank (tier-2 set-up and each step's agreement);
    ``settings``: ``ProcessSettings.from_env()`` where the caller reads the environment."""
    config = config_for(config, optimizer)
    config.check_devices(n_local)
    hparams = hyperparameters(optimizer)
    shards, sharded, aliased = _bindable(model, optimizer)
    layout = shard_layout(shards, family=optimizer_family(optimizer), group_options=hparams,
                          page_bytes=config.page_bytes, chunk_pages=config.chunk_pages)
    replicas = {replica_shard_count(cast(DTensor, param)) or 0 for param, _ in sharded}
    spec = StoreSpec(job_id, rank, node, local_rank, n_local, layout, config,
                     replica_shards=replicas.pop() if len(replicas) == 1 else 0)

    def bind(store: RetainedStore) -> RetainedFSDP2:
        return _bind_store(model, optimizer, store, (sharded, aliased), barrier, payload_fn, adopt=False,
                           settings=settings)

    return set_up_store(spec, bind, barrier=barrier, settings=settings, attach_with="attach_fsdp2")


def attach_fsdp2(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, job_id: str, rank: int,
                 barrier: Callable[[], None] | None = None, payload_fn: Callable[[], object] | None = None,
                 resume: bool = True, settings: ProcessSettings | None = None) -> RetainedFSDP2:
    """This rank's existing store (recovered, e.g. by ``updater.recovery.recover_node``): the
    local shards, their grads and optimizer state become its views and take its values, and
    training continues after the last committed iteration (``RetainedFSDP2.iteration``).
    ``resume=False``: views only, nothing written (a shadow binding while the active trainer
    still trains the same memory); call ``RetainedFSDP2.resume()`` once promoted."""
    hparams = hyperparameters(optimizer)
    shards, sharded, aliased = _bindable(model, optimizer)
    store = RetainedStore.attach(job_id, rank)
    expected = shard_layout(shards, family=optimizer_family(optimizer), group_options=hparams,
                            page_bytes=store.layout.page_bytes, chunk_pages=store.layout.chunk_pages)
    if expected != store.layout:
        store.close()
        raise ConfigurationError(f"rank {rank}: the model's local shards ({expected.describe()}) do not match the "
                                 f"retained store of job {job_id!r} ({store.layout.describe()})")
    try:
        bound = _bind_store(model, optimizer, store, (sharded, aliased), barrier, payload_fn, adopt=True,
                            resume=resume, settings=settings)
    except BaseException:  # e.g. IncompleteStoreError: nothing to adopt
        store.close()
        raise
    # The retained gradients are those of the last committed iteration (a rank killed mid-update
    # kept them for its roll-forward): the next iteration accumulates from zero.
    if resume:
        bound.zero_grad()
    else:
        bound.state.read_only = SHADOW_VIEWS  # a shadow never writes the active trainer's memory
    return bound
