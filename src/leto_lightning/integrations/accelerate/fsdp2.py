"""``LetoAccelerator`` with Accelerate's FSDP2 plugin: the plugin checked, Accelerate's FSDP2
path enabled on CPU, and the prepared model's local shards bound through the core binding.

**The plugin.** ``FullyShardedDataParallelPlugin(fsdp_version=2)`` as ``fsdp_plugin=``, or
``distributed_type: FSDP`` with ``fsdp_config: {fsdp_version: 2}`` in an ``accelerate launch``
config (which sets ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION=2`` for every worker).
FSDP1 (``fsdp_version: 1``, Accelerate's default) is refused with the advice to use version 2:
its flat parameters are not the per-parameter local shards the binding retains.

**CPU.** Accelerate 1.15 makes ``distributed_type`` FSDP only on accelerators (the MULTI_GPU
family, ``AcceleratorState.__init__``); without CUDA, with ``cpu=True`` it picks MULTI_CPU and
drops the plugin without a word (the model is wrapped in DDP), and without ``cpu=True`` every
rank trains alone. ``fsdp2_on_cpu`` does, on CPU, the one thing Accelerate does on GPUs: it
sets the state's ``distributed_type`` to FSDP (in ``AcceleratorState`` and in the
``PartialState`` values it copies, as ``AcceleratorState.__init__`` does) and its
``fsdp_plugin`` (with the mixed precision applied, as Accelerate does). From there on every
FSDP2 step is Accelerate's own code (``_prepare_fsdp2``: ``fully_shard`` on the default CPU
mesh over gloo, the optimizer switched to the DTensor parameters; ``clip_grad_norm_`` on
DTensor gradients). It works on a plain
``Accelerator`` too: the tests' reference is a plain one with it.

**Binding.** After Accelerate's ``prepare`` applied ``fully_shard`` and switched the optimizer's
parameters, ``updater.fsdp2.create_fsdp2`` (a new store) or ``attach_fsdp2`` (a shadow, or
``LETO_RESUME=retained``: views only, the values taken once promoted) re-points the shards,
their gradients and the optimizer state at the rank's store; the optimizer's param groups then
hold plain alias parameters over the padded local shards (``docs/fsdp2.md``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import ConfigurationError
from ...retained.config import RetainedConfig
from ...runtime.engine import RankPlace, TrainerEngine
from ...updater.fsdp2 import RetainedFSDP2
from .internals import set_shared_distributed_type

WHO = "LetoAccelerator"
USE_FSDP = "ACCELERATE_USE_FSDP"  # Accelerate's own variables (set by `accelerate launch` from a config)
FSDP_VERSION = "FSDP_VERSION"
_USE_V2 = ("use FullyShardedDataParallelPlugin(fsdp_version=2) (in a config file: fsdp_config: {fsdp_version: 2}), "
           "which shards each parameter with fully_shard")


def requested_plugin(kwargs: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> Any | None:
    """The FSDP2 plugin this ``LetoAccelerator`` is asked for (an argument, or ``accelerate
    launch``'s environment), or None; anything but FSDP2 refused naming the fix."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = kwargs.get("fsdp_plugin")
    if plugin is None:
        if env.get(USE_FSDP, "false").lower() != "true":
            return None
        version = env.get(FSDP_VERSION, "1")
        if version != "2":
            raise ConfigurationError(f"{USE_FSDP}=true with {FSDP_VERSION}={version} (an Accelerate config with "
                                     f"FSDP1): {WHO} retains FSDP2's per-parameter local shards -- {_USE_V2}")
        return FullyShardedDataParallelPlugin(fsdp_version=2)
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise ConfigurationError(f"{WHO}(fsdp_plugin={plugin!r}): not a FullyShardedDataParallelPlugin -- {_USE_V2}")
    if plugin.fsdp_version != 2:
        raise ConfigurationError(f"{WHO}(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version="
                                 f"{plugin.fsdp_version})): FSDP1's flat parameters are not the per-parameter local "
                                 f"shards {WHO} retains -- {_USE_V2}")
    refuse_options(plugin)
    return plugin


def refuse_options(plugin: Any) -> None:
    """FSDP2 options that move the shards out of the retained store."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        raise ConfigurationError(f"{WHO}: FullyShardedDataParallelPlugin(cpu_offload=...) keeps the shards in "
                                 "FSDP2's own offload buffers, not in retained memory -- leave cpu_offload off "
                                 "(fsdp_offload_params: false)")


def fsdp2_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Without CUDA, make Accelerate's state FSDP (module doc): what Accelerate itself does for
    the MULTI_GPU family. A no-op when Accelerate already chose FSDP."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise ConfigurationError(f"distributed_type={state.distributed_type} with an FSDP2 plugin: FSDP2 on CPU needs "
                                 "several processes over gloo (cpu=True under accelerate launch, torchrun or leto "
                                 "launch)")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    set_shared_distributed_type(DistributedType.FSDP)  # as AcceleratorState.__init__ ends


def bind(engine: TrainerEngine, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RetainedConfig,
         job_id: str, place: RankPlace, continuing: bool, barrier: Callable[[], None] | None,
         payload_fn: Callable[[], object]) -> RetainedFSDP2:
    """The FSDP2-prepared model's local shards bound to this rank's store: a new store, or (a
    continuation) the existing one's views, its values taken by ``RetainedFSDP2.resume()``.

    The torch optimizer's ``step`` attribute is put back as it was (an LR scheduler's wrapper):
    ``LetoAcceleratedOptimizer`` calls the binding's step itself, as for DDP, and a scheduler
    whose wrapper was replaced warns at every step."""
    wrapped = optimizer.__dict__.get("step")
    bound = engine.bind_fsdp2(model, optimizer, config, job_id=job_id, place=place, barrier=barrier,
                              payload_fn=payload_fn, continuing=continuing)
    if wrapped is not None:
        optimizer.step = wrapped  # type: ignore[method-assign]
    else:
        del optimizer.step
    return bound


