"""Every private Accelerate attribute Leto touches, and its one patch of an object's class.

Why a module of its own: Accelerate changes its private names between releases without notice
(``versions.py`` refuses untested releases for that reason). Each use is a small named function
here that says why Leto needs it; the other modules of the integration call these and touch
nothing private themselves. ``PRIVATE_ATTRIBUTES`` lists every private name used (the owner's
import path -> the names), ``PATCHES`` every class swap; ``tests/test_framework_internals.py``
checks them all against the installed Accelerate (an upgrade that removes one fails there,
naming it) and refuses private framework accesses anywhere else in the package.
"""

from __future__ import annotations

from typing import Any

# import path of the owner (a module or class) -> the private names used on it or its instances
PRIVATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    # _is_accelerate_prepared: what Accelerator.prepare marks the objects it prepared with
    "accelerate.accelerator.Accelerator": ("_optimizers", "_models", "_schedulers", "_custom_objects",
                                           "_is_accelerate_prepared"),
    "accelerate.state.GradientState": ("_set_sync_gradients",),
    "accelerate.state.PartialState": ("_shared_state",),
    "accelerate.optimizer.AcceleratedOptimizer": ("_is_overflow", "_accelerate_step_called",
                                                  "_optimizer_original_step_method"),
}

# framework attribute replaced -> why (``set_loader_class``)
PATCHES: dict[str, str] = {
    "accelerate.data_loader.DataLoaderShard.__class__":
        "a prepared loader becomes Leto's positioned subclass of its own class, in place (loader.py)",
    "accelerate.data_loader.DataLoaderDispatcher.__class__":
        "a dispatching loader gets the per-batch hook the same way (loader.py)",
}

# object's own ``__class__`` slot: Accelerate's loader adapter reports the wrapped DataLoader's
# class as ``__class__`` (a property without a setter), so plain assignment cannot swap it
_SET_CLASS = object.__dict__["__class__"].__set__


# -- the accelerator's registries ----------------------------------------------------------------
def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The optimizers ``prepare()`` returned, in order (the list itself): Leto binds the one
    optimizer to retained memory once its model is prepared."""
    optimizers: list[Any] = accelerator._optimizers
    return optimizers


def register_optimizer(accelerator: Any, prepared: Any) -> None:
    """Record a prepared optimizer as ``prepare_optimizer`` does (``save_state`` and
    ``load_state`` walk this list), for Leto's own ``LetoAcceleratedOptimizer``."""
    accelerator._optimizers.append(prepared)


def prepared_models(accelerator: Any) -> list[Any]:
    """The models ``prepare()`` returned, in order: their parameters decide when the optimizer
    can bind, and name the retained slots."""
    models: list[Any] = accelerator._models
    return models


def prepared_schedulers(accelerator: Any) -> list[Any]:
    """The prepared LR schedulers, in order: their state is in the resume payload, and a
    resumed ``prepare`` payload steps them once (``payload.finish_step``)."""
    schedulers: list[Any] = accelerator._schedulers
    return schedulers


def checkpointed_objects(accelerator: Any) -> list[Any]:
    """The objects given to ``register_for_checkpointing``, in order: their state is in the
    resume payload, as it is in ``save_state``'s files."""
    objects: list[Any] = accelerator._custom_objects
    return objects


def is_accelerate_prepared(obj: Any) -> bool:
    """Whether ``prepare`` already prepared ``obj`` (it is then passed on as it is)."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


# -- state ---------------------------------------------------------------------------------------
def set_sync_gradients(gradient_state: Any, value: bool) -> None:
    """Set whether this micro-step syncs gradients: a prepared scheduler steps only on a sync
    micro-step, and a resumed ``prepare`` payload must step them as the loop would have."""
    gradient_state._set_sync_gradients(value)


def set_shared_distributed_type(value: Any) -> None:
    """What ``AcceleratorState.__init__`` ends with: every later ``AcceleratorState()`` copies
    ``PartialState``'s shared values over its own, ``distributed_type`` included (FSDP2 on CPU,
    ``fsdp2.fsdp2_on_cpu``)."""
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = value


# -- the prepared optimizer's step ------------------------------------------------------------
def original_optimizer_step(prepared: Any) -> Any:
    """The torch optimizer's ``step`` as it was before Accelerate patched it inside
    ``scaler.step`` (put back after Leto's own patched step ran)."""
    return prepared._optimizer_original_step_method


def settle_scaler_step(prepared: Any) -> None:
    """After ``scaler.step`` ran Leto's patched step: whether the scaler skipped it (inf/nan),
    as ``AcceleratedOptimizer.step`` records it for ``step_was_skipped``."""
    prepared._is_overflow = not prepared._accelerate_step_called
    prepared._accelerate_step_called = False


def mark_step_not_skipped(prepared: Any) -> None:
    """``step_was_skipped`` is False: a resumed ``prepare`` payload's step committed (a step with
    inf/nan gradients never commits)."""
    prepared._is_overflow = False


# -- data loaders --------------------------------------------------------------------------------
def set_loader_class(loader: Any, cls: type) -> None:
    """Make ``loader`` an instance of ``cls`` (a subclass of its own class), in place: the loop
    holds this very object, so a new loader would not be what it iterates (``loader.py``)."""
    _SET_CLASS(loader, cls)
