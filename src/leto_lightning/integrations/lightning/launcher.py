"""The launcher of ``LetoStrategy``: runs the trainer function in this process, never spawns.

Why: Lightning's own launcher (like torchrun) watches the ranks it started and kills every one
of them when one exits -- exactly the failure Leto recovers from in place. Ranks are started
by ``leto launch`` (or any launcher that sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``). The
launcher is also the one place that sees ``fit()``'s arguments before Lightning resolves
``ckpt_path``: it turns ``LETO_RESUME=retained`` into ``ckpt_path="leto://retained"``.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.launcher import _Launcher

if TYPE_CHECKING:  # pragma: no cover
    from .strategy import LetoStrategy


class LetoLauncher(_Launcher):
    """Runs the trainer function in this process; never spawns ranks (``leto launch`` does)."""

    def __init__(self, strategy: "LetoStrategy") -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        env = strategy.cluster_environment
        if strategy.num_processes * strategy.num_nodes > 1 and not (env and env.creates_processes_externally):
            raise RuntimeError("LetoStrategy does not start ranks itself: Lightning's launcher kills every rank when "
                               "one dies, which is what Leto recovers from. Start the script with `leto launch "
                               "--nproc-per-node N script.py` (or another launcher that sets RANK/WORLD_SIZE).")
        if getattr(function, "__name__", "") == "_fit_impl":
            bound = inspect.signature(function).bind(*args, **kwargs)
            bound.arguments["ckpt_path"] = strategy.resolve_fit_ckpt_path(bound.arguments.get("ckpt_path"))
            args, kwargs = bound.args, bound.kwargs
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no processes."""
