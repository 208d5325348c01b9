"""What ``LetoStrategy`` cannot protect, rejected early with what to do instead.

Each check names the combination and the reason: a silently unprotected step (state changed
outside a transaction, or not in retained memory) is worse than a refusal.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import Strategy
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.optim import ZeroRedundancyOptimizer

from ...errors import ConfigurationError
from ...updater.retained_optimizer import optimizer_family
from ...updater.zero1 import check_zero1
from .internals import is_mock_optimizer

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def reject_ddp_options(kwargs: dict[str, Any]) -> None:
    """DDP options that would change parameters or gradients outside retained memory."""
    if kwargs.get("gradient_as_bucket_view"):
        raise ConfigurationError("gradient_as_bucket_view=True makes gradients views into DDP's "
                                 "buckets; LetoStrategy keeps "
                                 "them in retained memory -- leave it False")
    if kwargs.get("model_averaging_period") is not None or kwargs.get("ddp_comm_state") is not None:
        raise ConfigurationError(
            "post-local-SGD model averaging changes parameters outside the optimizer step, which "
            "retained transactions cannot protect; use plain DDP gradient averaging with LetoStrategy")
    start = kwargs.pop("start_method", "popen")
    if start != "popen":
        raise ConfigurationError(f"start_method={start!r}: LetoStrategy starts no processes; launch "
                                 "ranks with `leto launch`")


FSDP2_ADVICE = ("Leto retains sharded state with FSDP2 only: use Trainer(strategy='leto_fsdp2') and shard with "
                "torch.distributed.fsdp.fully_shard in LightningModule.configure_model")


def refuse_fsdp1(model: torch.nn.Module | None, who: str) -> None:
    """A module wrapped in ``FullyShardedDataParallel`` (FSDP1) keeps state Leto cannot retain."""
    wrapped = [name or type(m).__name__ for name, m in (model.named_modules() if model is not None else ())
               if isinstance(m, FullyShardedDataParallel)]
    if wrapped:
        raise ConfigurationError(f"{who}: module {wrapped[0]!r} is wrapped in FullyShardedDataParallel (FSDP1); "
                                 f"{FSDP2_ADVICE}")


def check_sharded_model(model: torch.nn.Module, who: str) -> None:
    """``LetoModelParallelStrategy``: the model must be sharded by ``fully_shard`` (FSDP2)."""
    refuse_fsdp1(model, who)
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ConfigurationError(f"{who}: the model is not sharded ({type(model).__name__} has no fully_shard "
                                 "module): apply torch.distributed.fsdp.fully_shard to its blocks and to the model in "
                                 "LightningModule.configure_model (mesh=self.device_mesh['data_parallel']), or use "
                                 "strategy='leto' (DDP)")


def check_sharded_trainer(strategy: Strategy, trainer: pl.Trainer) -> None:
    """What ``LetoModelParallelStrategy`` cannot protect, rejected before anything is allocated."""
    precision = strategy.precision_plugin
    name = getattr(precision, "precision", None)
    if type(precision) is not Precision or name != "32-true":
        raise ConfigurationError(f"precision {name!r} ({type(precision).__name__}): {type(strategy).__name__} trains "
                                 "with Trainer(precision='32-true'); for mixed precision pass fully_shard(..., "
                                 "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) in configure_model "
                                 "(the retained master shards stay fp32)")
    check_device(strategy)


def check_trainer(strategy: Strategy, trainer: pl.Trainer) -> None:
    """Combinations LetoStrategy cannot protect, rejected before anything is allocated."""
    check_precision(strategy.precision_plugin)
    refuse_fsdp1(strategy.model, type(strategy).__name__)
    check_device(strategy)


def check_device(strategy: Strategy) -> None:
    """Retained memory lives where the model trains: host memory (``accelerator="cpu"``) or CUDA
    device memory owned by the agent's state manager (``"gpu"``/``"cuda"``); nothing else."""
    device = strategy.root_device
    if device.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"device {device}: {type(strategy).__name__} keeps retained memory in host memory "
                                 "or CUDA device memory -- train with accelerator='cpu', 'gpu' or 'cuda'")


def check_precision(precision: Precision) -> None:
    """``32-true``, ``bf16-mixed`` and ``16-mixed`` with torch's own ``GradScaler``: its state is
    in every resume payload, and ``resume.finish_batch`` replays the ``update()`` of a step that
    committed (only steps without inf/nan gradients run a transaction)."""
    name = getattr(precision, "precision", None)
    if type(precision) not in (Precision, MixedPrecision) or name not in PRECISIONS:
        raise ConfigurationError(
            f"precision {name!r} ({type(precision).__name__}) is not supported "
            "by LetoStrategy: use one "
            f"of {PRECISIONS} (Lightning's own MixedPrecision plugin for the mixed ones); true half "
            "precision is untested, and sharded precision plugins (FSDP, DeepSpeed) cannot be combined "
            "with a DDP strategy.")
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and (not isinstance(scaler, torch.amp.GradScaler)
                               or type(scaler).update is not torch.amp.GradScaler.update
                               or type(scaler).state_dict is not torch.amp.GradScaler.state_dict):
        raise ConfigurationError(
            f"16-mixed with {type(scaler).__name__}: LetoStrategy replays "
            "torch.amp.GradScaler's own "
            "update() of a committed step on resume; a scaler that changes update() or state_dict() "
            "cannot be replayed exactly -- use torch.amp.GradScaler")


def the_optimizer(strategy: Strategy, trainer: pl.Trainer) -> torch.optim.Optimizer:
    """The one optimizer LetoStrategy binds; anything it cannot protect is rejected by name."""
    if len(strategy.optimizers) != 1:
        raise ConfigurationError(f"LetoStrategy protects exactly one optimizer; configure_optimizers returned "
                                 f"{len(strategy.optimizers)}")
    optimizer = strategy.optimizers[0]
    if is_mock_optimizer(optimizer):
        raise ConfigurationError("configure_optimizers() returned None: LetoStrategy protects the optimizer's state "
                                 "and the updates, and this fit has neither -- return an optimizer, or train "
                                 "without one under strategy='ddp'")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigurationError("LBFGS re-evaluates its closure inside step(); a retained "
                                 "transaction runs the closure once "
                                 "-- use another optimizer with LetoStrategy")
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # ZeRO-1: the owned shard retained (updater.zero1)
        return check_zero1(optimizer)  # parameters_as_bucket_view / overlap_with_ddp refused, naming the fix
    if type(optimizer).__module__.startswith("torch.distributed"):
        raise ConfigurationError(f"{type(optimizer).__name__} shards or wraps optimizer state across "
                                 "ranks; LetoStrategy "
                                 "retains each rank's full optimizer state -- use a plain torch.optim optimizer")
    if optimizer_family(optimizer) == "generic":  # raises for fused / capturable / differentiable
        check_closure_use(optimizer, trainer.lightning_module.automatic_optimization)
    return optimizer


def check_closure_use(optimizer: torch.optim.Optimizer, automatic: bool) -> None:
    """An optimizer stepped by its own ``step()`` (every one but SGD, Adam, AdamW) must work the
    way a retained transaction calls it: the closure (forward, backward) runs once before the
    transaction, then ``step()`` without a closure. Checked on throwaway instances of the class
    (the real optimizer is untouched), before any memory is allocated.

    In automatic optimization an optimizer whose ``step(closure)`` never calls the closure
    trains nothing under DDP: Lightning stops at the first step ("The closure hasn't been
    executed"). A transaction would run the closure itself and hide that, so it is refused."""
    name = type(optimizer).__name__
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        return torch.zeros(())

    without, with_closure = _throwaway(optimizer), _throwaway(optimizer)
    try:
        without.step()
    except Exception as exc:  # the optimizer's own code: whatever it raises means "cannot step like this"
        raise ConfigurationError(
            f"{name}.step() cannot run without a closure, as a retained transaction calls it (on a throwaway "
            f"instance: {type(exc).__name__}: {exc}). LetoStrategy runs the "
            "closure (forward and backward) once, then step() inside a retained transaction; an optimizer that "
            "evaluates the closure inside step() (SAM-like, or a step(closure) that calls it unconditionally) "
            "cannot be protected -- make closure optional in step(), use another optimizer, or strategy='ddp'"
            ) from exc
    if automatic:
        # worked without one: a failure here is the optimizer's own error
        with_closure.step(closure)  # type: ignore[arg-type]  # a loss tensor, as Lightning passes
    if automatic and len(calls) != 1:
        what = "never calls its closure" if not calls else f"calls its closure {len(calls)} times"
        raise ConfigurationError(
            f"{name}.step(closure) {what}: Lightning's automatic optimization expects one call (under DDP it "
            "stops with 'The closure hasn't been executed' when there is none), and a retained transaction runs "
            "the closure exactly once -- call closure() once in step(), or use manual optimization")


def _throwaway(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new instance of ``optimizer``'s class on one parameter with a gradient, built from its
    defaults (as ``updater.whole_state.probe_state`` builds it)."""
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 0.5)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    try:
        return type(optimizer)([param], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except Exception as exc:  # the optimizer's own constructor
        raise ConfigurationError(
            f"{type(optimizer).__name__} cannot be rebuilt from its defaults ({type(exc).__name__}: {exc}): "
            "LetoStrategy learns the layout of its state from a throwaway instance -- wrapper optimizers "
            "(SAM-like, taking a base optimizer) are not supported; use the optimizer itself, or strategy='ddp'"
            ) from exc
