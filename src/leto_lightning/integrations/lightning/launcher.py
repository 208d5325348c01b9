"""The launcher of ``LetoStrategy``: runs the trainer function in this process, never spawns.

Why: Lightning's own launcher (like torchrun) watches the ranks it started and kills every one
of them when one exits -- exactly the failure Leto recovers from in place. Ranks are started
by ``leto launch``. The launcher is also the one place that sees ``fit()``'s arguments before
Lightning resolves ``ckpt_path``: it turns ``LETO_RESUME=retained`` (and, under ``leto
launch``, the shadow role) into ``ckpt_path="leto://retained"``, and resolves a checkpoint
file ("last", "best", a path) the way Lightning will.

Which launchers work (checked when the Trainer is built, ``check_launch``):

- ``leto launch --nproc-per-node N script.py``: yes (``LETO_ROLE`` in the environment).
- ``python script.py`` with ``devices > 1`` (Lightning's own launcher): refused -- it kills
  every rank when one dies.
- ``torchrun``: refused -- it restarts every worker when one fails, and nothing would recover
  the retained memory of the killed ones.
- ranks started by hand with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (tests, custom launchers):
  accepted; recovery is then the caller's job (``updater.recovery.recover_node`` and
  ``fit(ckpt_path="leto://retained")``).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.launcher import _Launcher

from .environment import under_leto_launch

if TYPE_CHECKING:  # pragma: no cover
    from .strategy import LetoStrategy


def _script() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "train.py"


def check_launch(strategy: "LetoStrategy") -> None:
    """Refuse launchers that kill every rank when one dies, naming the command that works."""
    if under_leto_launch():
        return
    ranks = strategy.num_processes * strategy.num_nodes
    command = f"`leto launch --nproc-per-node {strategy.num_processes} {_script()}`"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        raise RuntimeError(
            "LetoStrategy does not run under torchrun: torchrun restarts every worker when one fails, which is the "
            f"failure Leto recovers from in place (and nothing would recover the killed ranks' retained memory). "
            f"Start the script with {command} instead.")
    env = strategy.cluster_environment
    if ranks > 1 and not (env is not None and env.creates_processes_externally):
        raise RuntimeError(
            f"LetoStrategy does not start ranks itself (Trainer asks for {ranks} devices): Lightning's launcher kills "
            f"every rank when one dies, which is what Leto recovers from in place. Start the script with {command}.")


class LetoLauncher(_Launcher):
    """Runs the trainer function in this process; never spawns ranks (``leto launch`` does)."""

    def __init__(self, strategy: "LetoStrategy") -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        check_launch(strategy)
        if getattr(function, "__name__", "") == "_fit_impl":
            bound = inspect.signature(function).bind(*args, **kwargs)
            bound.arguments["ckpt_path"] = strategy.resolve_fit_ckpt_path(bound.arguments.get("ckpt_path"), trainer)
            args, kwargs = bound.args, bound.kwargs
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no processes."""
