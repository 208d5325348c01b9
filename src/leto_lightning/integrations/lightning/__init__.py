"""Lightning integration: ``Trainer(strategy="leto")`` (DDP) and ``Trainer(strategy="leto_fsdp2")``
(FSDP2, ``fully_shard`` in ``configure_model``) (docs/design.md section 2.6, docs/lightning.md).

Importing this package makes the ``"leto"`` and ``"leto_fsdp2"`` strategy names known to Lightning's
``StrategyRegistry`` -- at once if ``lightning.pytorch`` is already imported, otherwise the
moment it is (``_autoregister``), so importing this package costs nothing when Lightning is
never used. Registration is idempotent. The public names load on first access.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from . import _autoregister, launch_guard

_EXPORTS = {
    "LetoStrategy": "strategy",
    "LetoModelParallelStrategy": "fsdp2_strategy",
    "FSDP2_STRATEGY_NAME": "fsdp2_strategy",
    "STRATEGY_NAME": "strategy",
    "LetoLoopStateCallback": "callback",
    "ResumableDataLoader": "data",
    "LetoRuntimeOptions": "options",
    "RETAINED_CKPT": "options",
}
__all__ = [
    "FSDP2_STRATEGY_NAME",
    "RETAINED_CKPT",
    "STRATEGY_NAME",
    "LetoLoopStateCallback",
    "LetoModelParallelStrategy",
    "LetoRuntimeOptions",
    "LetoStrategy",
    "ResumableDataLoader",
    "register",
]


def register() -> None:
    """Register ``"leto"`` with ``lightning.pytorch``'s ``StrategyRegistry`` (idempotent).

    Runs right after ``lightning.pytorch`` has executed, which may be in the middle of importing
    one of this package's modules (``import ...lightning.callback`` imports Lightning first):
    then ``strategy.py`` cannot be imported yet, so a factory that imports it on first use is
    registered; ``strategy.py`` replaces it with the class once it is complete."""
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = sys.modules.get(f"{__name__}.strategy")
    if strategy is not None and hasattr(strategy, "LetoStrategy"):
        strategy.LetoStrategy.register_strategies(StrategyRegistry)
    elif "leto" not in StrategyRegistry:
        StrategyRegistry.register("leto", _make_strategy, description=_DESCRIPTION)
    sharded = sys.modules.get(f"{__name__}.fsdp2_strategy")
    if sharded is not None and hasattr(sharded, "LetoModelParallelStrategy"):
        sharded.LetoModelParallelStrategy.register_strategies(StrategyRegistry)
    elif "leto_fsdp2" not in StrategyRegistry:
        StrategyRegistry.register("leto_fsdp2", _make_fsdp2_strategy, description=_FSDP2_DESCRIPTION)
    launch_guard.install()  # under leto launch: a Trainer without a Leto strategy fails naming it


_DESCRIPTION = "Leto: DDP with retained optimizer state and in-place recovery"
_FSDP2_DESCRIPTION = "Leto: FSDP2 (fully_shard) with retained local shards"


def _make_strategy(**kwargs: Any) -> Any:
    """``StrategyRegistry.get("leto")`` before ``strategy.py`` was imported: import it now."""
    from .strategy import LetoStrategy

    return LetoStrategy(**kwargs)


def _make_fsdp2_strategy(**kwargs: Any) -> Any:
    """``StrategyRegistry.get("leto_fsdp2")`` before ``fsdp2_strategy.py`` was imported."""
    from .fsdp2_strategy import LetoModelParallelStrategy

    return LetoModelParallelStrategy(**kwargs)


_make_strategy.leto_factory = True  # type: ignore[attr-defined]  # strategy.py replaces only this
_make_fsdp2_strategy.leto_factory = True  # type: ignore[attr-defined]  # fsdp2_strategy.py replaces only this


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_autoregister.install(register)
