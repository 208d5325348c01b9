"""The optimizer the precision plugin steps: a proxy whose ``step`` is a retained transaction.

Why a proxy and not a patched optimizer: Lightning's precision plugins call
``optimizer.step(closure)`` (or ``scaler.step(optimizer)``), and LR schedulers wrap
``optimizer.step`` on the *instance* to track calls. Replacing or deleting that attribute
breaks the scheduler's bookkeeping; handing the plugin a different object does not. The proxy
class is created per optimizer class and subclasses it, so ``isinstance(opt, AdamW)`` in user
hooks (``on_before_optimizer_step``, ``configure_gradient_clipping``) still holds; everything
else -- ``param_groups``, ``state``, ``defaults``, ``state_dict`` -- is the real optimizer's.

Under FSDP2 the real optimizer's groups hold plain aliases of the padded local shards
(``updater.fsdp2``); the precision plugin clips ``group["params"]`` of the optimizer it steps,
and the norm must be the global one over the DTensor parameters, as under plain FSDP2. So a
proxy made with ``group_params`` shows each group with its DTensor parameters
(``ShardedGroup``: every other key, read or written, is the real group's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch

from ...errors import ArgumentError, UsageError

_PROXY_CLASSES: dict[type, type] = {}
_OWN = ("_leto_optimizer", "_leto_step", "_leto_groups")


class _RetainedStepProxy:
    """Mixin placed before the optimizer class in the proxy's MRO (see ``proxy_for``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[Callable | None], Any],
                 group_params: Sequence[Sequence[torch.nn.Parameter]] | None = None) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: all state is the real one's.
        object.__setattr__(self, "_leto_optimizer", optimizer)
        object.__setattr__(self, "_leto_step", step_fn)
        groups = None if group_params is None else [
            ShardedGroup(g, params) for g, params in zip(optimizer.param_groups, group_params, strict=True)]
        object.__setattr__(self, "_leto_groups", groups)

    # -- the real optimizer's state --------------------------------------------------------
    @property
    def param_groups(self) -> list:
        groups = object.__getattribute__(self, "_leto_groups")
        return self._leto_optimizer.param_groups if groups is None else groups

    @property
    def state(self) -> dict:
        return self._leto_optimizer.state

    @property
    def defaults(self) -> dict:
        return self._leto_optimizer.defaults

    def state_dict(self) -> dict:
        return self._leto_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        raise UsageError("the optimizer's state lives in retained memory: load a checkpoint through the Trainer "
                         "(LetoStrategy adopts it), not through the step proxy")

    def add_param_group(self, param_group: dict) -> None:
        raise UsageError("parameters cannot be added after LetoStrategy bound the optimizer to retained memory; "
                         "add every param group in configure_optimizers")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._leto_optimizer.zero_grad(set_to_none)

    # -- the step --------------------------------------------------------------------------
    def step(self, closure: Callable | None = None, **kwargs: Any) -> Any:
        if kwargs:
            raise ArgumentError(f"optimizer.step() got {sorted(kwargs)}: a retained step takes only the closure")
        return self._leto_step(closure)

    # -- everything else is the real optimizer's ---------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in _OWN:
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_leto_optimizer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._leto_optimizer, name, value)

    def __repr__(self) -> str:
        return f"LetoRetainedStep({self._leto_optimizer!r})"

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        # never pickle the proxy: pickle what it stands for
        return (_identity, (self._leto_optimizer,))


def _identity(obj: Any) -> Any:
    return obj


def proxy_class(cls: type) -> type:
    """``Leto<Optimizer>``: a subclass of ``cls`` whose ``step`` runs a retained transaction."""
    if cls not in _PROXY_CLASSES:
        _PROXY_CLASSES[cls] = type(f"Leto{cls.__name__}", (_RetainedStepProxy, cls), {"__module__": __name__})
    return _PROXY_CLASSES[cls]


def proxy_for(optimizer: torch.optim.Optimizer, step_fn: Callable[[Callable | None], Any],
              group_params: Sequence[Sequence[torch.nn.Parameter]] | None = None) -> torch.optim.Optimizer:
    """A proxy for ``optimizer`` whose ``step(closure)`` calls ``step_fn(closure)``;
    ``group_params``: the parameters each group shows instead of its own (FSDP2)."""
    return proxy_class(type(optimizer))(optimizer, step_fn, group_params)


class ShardedGroup(MutableMapping):
    """A real param group seen with other ``"params"`` (the DTensor parameters its aliases
    stand for): reads and writes of every other key (``lr``, ...) go to the real group."""

    def __init__(self, group: dict, params: Sequence[torch.nn.Parameter]) -> None:
        self._group = group
        self._params = list(params)

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise UsageError("the params of a retained FSDP2 param group are bound to retained memory; "
                             "build every group in configure_optimizers")
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)


def real_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer behind a proxy (or the argument itself)."""
    return optimizer._leto_optimizer if isinstance(optimizer, _RetainedStepProxy) else optimizer
