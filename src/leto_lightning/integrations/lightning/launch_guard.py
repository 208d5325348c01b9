"""Under ``leto launch``: a ``Trainer`` whose strategy is not a Leto one fails at once, naming it.

Why: ``leto launch`` starts every rank's active trainer and its shadows, and already listens on
``MASTER_PORT``. A script that builds ``Trainer(strategy="ddp")`` (or ``"fsdp"``, or the
default) there used to fail deep in ``init_process_group`` (``EADDRINUSE``) -- or, with
FSDP1 on a GPU, would train with nothing retained. Lightning has no hook that sees every
strategy choice, so this wraps ``Trainer.__init__`` in trainer processes of ``leto launch``
only (installed when ``lightning.pytorch`` is imported there; never elsewhere), through
``internals.replace_trainer_init`` (the package's one patch of a Lightning class).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ...env import under_launcher
from ...errors import ConfigurationError

# Imports of this package's modules happen inside the functions: install() runs right after
# lightning.pytorch executed, possibly in the middle of importing one of them (__init__.register).

LETO_STRATEGIES = ("leto", "leto_fsdp2")


def install() -> None:
    """Wrap ``Trainer.__init__`` once, in a trainer process of ``leto launch``."""
    if not under_launcher(os.environ):
        return
    from .internals import replace_trainer_init

    replace_trainer_init(_guard)


def _guard(init: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__`` that refuses FSDP1 first and a strategy Leto cannot protect after."""

    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("strategy", "auto")
        refuse_fsdp1_strategy(given)
        init(self, *args, **kwargs)
        check_leto_strategy(given, self.strategy)

    return guarded


def _shown(given: Any) -> str:
    return repr(given) if isinstance(given, str) else f"{type(given).__name__}()"


def refuse_fsdp1_strategy(given: Any) -> None:
    """Lightning's ``"fsdp"`` strategies (FSDP1), by name or instance, before Lightning's own checks."""
    from lightning.pytorch.strategies import FSDPStrategy

    from .checks import FSDP2_ADVICE

    names = FSDPStrategy.get_registered_strategies()
    if (isinstance(given, str) and given in names) or isinstance(given, FSDPStrategy):
        raise ConfigurationError(f"Trainer(strategy={_shown(given)}) is FSDP1 (FullyShardedDataParallel), which "
                                 f"Leto cannot protect; {FSDP2_ADVICE}")


def check_leto_strategy(given: Any, strategy: Any) -> None:
    """Under ``leto launch`` only a Leto strategy trains (the agent owns ranks and port)."""
    from .fsdp2_strategy import LetoModelParallelStrategy
    from .strategy import LetoStrategy

    if not isinstance(strategy, (LetoStrategy, LetoModelParallelStrategy)):
        raise ConfigurationError(
            f"Trainer(strategy={_shown(given)}) under `leto launch` is {type(strategy).__name__}, which Leto cannot "
            f"protect (and whose process group would collide with the agent's): use strategy='leto' (DDP) or "
            f"strategy='leto_fsdp2' (FSDP2, fully_shard in configure_model)")
