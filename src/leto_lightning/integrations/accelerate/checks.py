"""What ``LetoAccelerator`` cannot protect, refused at construction with what to do instead.

A silently unprotected step (state changed outside a transaction, or not in retained memory)
is worse than a refusal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigurationError

WHO = "LetoAccelerator"
_ENGINES = (
    ("deepspeed_plugin", "ACCELERATE_USE_DEEPSPEED", "DeepSpeed",
     "DeepSpeed shards and updates optimizer state inside its own engine"),
    ("deepspeed_plugins", "ACCELERATE_USE_DEEPSPEED", "DeepSpeed",
     "DeepSpeed shards and updates optimizer state inside its own engine"),
    ("megatron_lm_plugin", "ACCELERATE_USE_MEGATRON_LM", "Megatron-LM",
     "Megatron-LM runs its own optimizer over sharded state"),
)  # FSDP: only FSDP2, checked in fsdp2.py
_FIX = ("use plain data parallelism (`distributed_type: MULTI_GPU`, as in configs/accelerate/leto.yaml), or the "
        "plain Accelerator without Leto")


def refuse_unsupported(kwargs: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> None:
    """DeepSpeed, Megatron-LM (as arguments or from ``accelerate launch``'s config), and DDP
    options that move gradients out of retained memory (FSDP: ``fsdp2.requested_plugin``)."""
    for arg, var, name, why in _ENGINES:
        if kwargs.get(arg) is not None:
            raise ConfigurationError(f"{WHO}({arg}=...): {why}, which Leto's retained transactions cannot "
                                     f"protect -- {_FIX}")
        if env.get(var, "false").lower() == "true":
            raise ConfigurationError(f"{var}=true (an Accelerate config with {name}): {why}, which Leto's retained "
                                     f"transactions cannot protect -- {_FIX}")
    from accelerate.utils import DistributedDataParallelKwargs

    for handler in kwargs.get("kwargs_handlers") or ():
        if isinstance(handler, DistributedDataParallelKwargs):
            if handler.gradient_as_bucket_view:
                raise ConfigurationError(
                    "DistributedDataParallelKwargs(gradient_as_bucket_view=True) makes gradients views into DDP's "
                    f"buckets; {WHO} keeps them in retained memory -- leave gradient_as_bucket_view=False")
            if handler.comm_hook is not None and str(handler.comm_hook).lower() not in ("no", "commhooktype.no"):
                raise ConfigurationError(
                    f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook}) changes how gradients are "
                    f"reduced (compression or model averaging); {WHO} supports DDP's plain all-reduce -- "
                    "drop comm_hook")


def check_distributed(acc: Any) -> None:
    """After ``Accelerator.__init__``: the distributed type and device it chose."""
    from accelerate.utils import DistributedType

    kind = acc.distributed_type
    if kind == DistributedType.FSDP and not acc.is_fsdp2:
        raise ConfigurationError(f"distributed_type={kind} with FSDP1: {WHO} retains FSDP2's local shards -- use "
                                 "FullyShardedDataParallelPlugin(fsdp_version=2)")
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP):
        raise ConfigurationError(f"distributed_type={kind}: {WHO} supports NO, MULTI_CPU and MULTI_GPU (DDP) and "
                                 f"FSDP2 -- {_FIX}")
    if acc.device.type not in ("cpu", "cuda"):
        raise ConfigurationError(
            f"device {acc.device}: {WHO} keeps retained memory in host memory or CUDA device memory -- train on "
            f"CUDA GPUs or with {WHO}(cpu=True)")


def the_optimizer(optimizers: list) -> Any:
    """The one prepared optimizer LetoAccelerator protects; anything it cannot is refused by name."""
    import torch

    from ...updater.retained_optimizer import optimizer_family

    if len(optimizers) != 1:
        raise ConfigurationError(f"{WHO} protects exactly one optimizer; prepare() was given {len(optimizers)}")
    optimizer = optimizers[0].optimizer
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigurationError("LBFGS re-evaluates its closure inside step(); a retained transaction runs the "
                                 f"closure once -- use another optimizer with {WHO}")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ...updater.zero1 import check_zero1

    if isinstance(optimizer, ZeroRedundancyOptimizer):  # ZeRO-1: the owned shard retained (zero1.py)
        check_zero1(optimizer)  # parameters_as_bucket_view / overlap_with_ddp refused, naming the fix
        return optimizers[0]
    if type(optimizer).__module__.startswith("torch.distributed"):
        raise ConfigurationError(f"{type(optimizer).__name__} shards or wraps optimizer state across ranks; {WHO} "
                                 "retains each rank's full optimizer state -- use a plain torch.optim optimizer")
    optimizer_family(optimizer)  # raises for fused / capturable / differentiable
    return optimizers[0]
