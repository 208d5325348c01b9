"""Every private torch attribute Leto touches outside the FSDP2 binding, in one place.

Why a module of its own: torch changes its private names without notice. Each use below is a
small named function saying why Leto needs it, and ``PRIVATE_ATTRIBUTES`` lists every private
name they read or write, so ``tests/test_framework_internals.py`` checks them all against the
installed torch and an upgrade that removes one fails there, naming it -- not deep inside a
recovery. ``tests/test_framework_internals.py`` also refuses private framework accesses anywhere
else in the package (the FSDP2 binding keeps its own inventory: ``updater.fsdp2.PRIVATE_ATTRIBUTES``).

It sits in ``retained`` (the lowest layer that imports torch) so that the retained backends,
the updater and both integrations can use it; it imports nothing but torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

# import path of the owner (a module or class) -> the private names used on it or its instances
PRIVATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    # set by an LR scheduler's wrapper of optimizer.step, read by LRScheduler.step
    "torch.optim.lr_scheduler": ("_opt_called", "_wrapped_by_lr_sched"),
    "torch": ("_amp_update_scale_", "_utils"),
    "torch._utils": ("_rebuild_tensor",),
    "torch.storage.TypedStorage": ("_internal",),  # the keyword of its internal constructor
    "torch.cuda": ("_lazy_init",),
    "torch.cuda.memory": ("_set_allocator_settings",),
    "torch.UntypedStorage": ("_new_shared_cuda", "_share_cuda_", "_release_ipc_counter_cuda"),
    "torch.amp.GradScaler": ("_growth_tracker",),  # a key of its state_dict()
    "torch.nn.Module": ("_metadata",),  # what state_dict() sets on the OrderedDict it returns
    "torch.utils.data.dataloader": ("_SingleProcessDataLoaderIter",),
    "torch.utils.data.dataloader._SingleProcessDataLoaderIter": ("_sampler_iter", "_num_yielded"),
    "torch.distributed.optim.ZeroRedundancyOptimizer": ("_overlap_with_ddp",),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam": ("_sharded_param_data",),
}

# ``GradScaler.state_dict()``'s key for its private growth tracker: Leto advances a captured
# scaler state by the ``update()`` of a step that committed before a crash.
GROWTH_TRACKER = "_growth_tracker"


# -- optimizers and LR schedulers -----------------------------------------------------------
def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What an LR scheduler's wrapper of ``optimizer.step`` records. Leto runs the update itself
    (a retained transaction), or replays a step that committed before a crash; without this
    mark ``LRScheduler.step`` warns that it was called before ``optimizer.step()``."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def mark_wrapped_by_lr_scheduler(step: Callable[..., Any]) -> None:
    """Mark a replacement ``optimizer.step`` as a scheduler's wrapper: an LR scheduler built
    before Leto replaced the step checks for this mark (else it warns that ``optimizer.step``
    was overridden); one built after leaves the step alone, which records the call itself."""
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def zero_overlaps_with_ddp(zero: Any) -> bool:
    """``ZeroRedundancyOptimizer(overlap_with_ddp=True)``: it then steps inside DDP's
    communication hook, outside Leto's transactions (refused); the option is kept privately."""
    return bool(getattr(zero, "_overlap_with_ddp", False))


def amp_update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
                      growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """torch's own ``GradScaler.update`` kernel (in place), so a scaler update Leto replays after
    a recovery is bit-exact with the one the crashed run would have made."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)


# -- state dicts and data loaders -------------------------------------------------------------
def copy_state_dict_metadata(source: Any, target: Any) -> None:
    """A module state dict's version metadata (``state_dict()._metadata``), which
    ``load_state_dict`` passes to every module's ``_load_from_state_dict``: a copied state dict
    must keep it to load the same way."""
    if hasattr(source, "_metadata"):
        target._metadata = source._metadata


def skip_sampled_indices(iterator: Any, n: int) -> bool:
    """Advance a single-process map-style loader iterator by ``n`` batches drawing only their
    indices (no ``__getitem__``, no collation); False for any other iterator (the caller loads
    and drops the batches). torch keeps the index iterator and the yield count privately."""
    if not isinstance(iterator, _SingleProcessDataLoaderIter):
        return False
    for _ in range(n):
        next(iterator._sampler_iter)
    iterator._num_yielded += n
    return True


def fsdp_param_sharded_data(fsdp_param: Any) -> torch.Tensor:
    """An ``FSDPParam``'s padded local shard, which every forward all-gathers from: the retained
    binding points it at retained memory (``updater.fsdp2``, which lists it too)."""
    data: torch.Tensor = fsdp_param._sharded_param_data
    return data


# -- CUDA IPC (the retained CUDA backend) ----------------------------------------------------
def uint8_tensor(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``storage``, built the way torch's ``rebuild_cuda_tensor`` does
    (no public constructor takes an untyped storage as it is)."""
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
    return torch._utils._rebuild_tensor(typed, 0, (nbytes,), (1,))


def cuda_lazy_init() -> None:
    """Initialise CUDA as torch does before its own IPC rebuild (``torch.cuda.init`` would also
    do, but this is what ``rebuild_cuda_tensor`` calls)."""
    torch.cuda._lazy_init()


def open_shared_cuda(ipc: tuple) -> torch.UntypedStorage:
    """Open another process's device buffer from its IPC handle (``share_cuda``'s tuple):
    torch's only way in without ``torch.multiprocessing``'s pickling."""
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared_cuda(*ipc)
    return storage


def share_cuda(tensor: torch.Tensor) -> tuple:
    """The IPC handle of ``tensor``'s device storage (what ``torch.multiprocessing`` sends)."""
    handle: tuple = tensor.untyped_storage()._share_cuda_()
    return handle


def release_ipc_counter(ipc: tuple) -> None:
    """Drop the reference count a ``share_cuda`` handle holds, as a receiving process would:
    the state manager keeps its buffers itself (see ``retained/backends/cuda_ipc.py``)."""
    torch.UntypedStorage._release_ipc_counter_cuda(ipc[4], ipc[5])


def set_cuda_allocator_settings(settings: str) -> None:
    """Change the caching allocator's settings after start-up (``PYTORCH_CUDA_ALLOC_CONF`` is read
    once): expandable segments cannot be shared as IPC handles."""
    torch.cuda.memory._set_allocator_settings(settings)
