"""Lightning integration: ``Trainer(strategy="leto")`` (docs/design.md section 2.6).

Importing this package makes the ``"leto"`` strategy name known to Lightning's
``StrategyRegistry`` -- at once if ``lightning.pytorch`` is already imported, otherwise the
moment it is (``_autoregister``), so importing this package costs nothing when Lightning is
never used. Registration is idempotent. The public names load on first access.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from . import _autoregister

_EXPORTS = {
    "LetoStrategy": "strategy",
    "STRATEGY_NAME": "strategy",
    "LetoLoopStateCallback": "callback",
    "ResumableDataLoader": "data",
    "LetoRuntimeOptions": "options",
    "RETAINED_CKPT": "options",
}
__all__ = [
    "RETAINED_CKPT",
    "STRATEGY_NAME",
    "LetoLoopStateCallback",
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


_DESCRIPTION = "Leto: DDP with retained optimizer state and in-place recovery"


def _make_strategy(**kwargs: Any) -> Any:
    """``StrategyRegistry.get("leto")`` before ``strategy.py`` was imported: import it now."""
    from .strategy import LetoStrategy

    return LetoStrategy(**kwargs)


_make_strategy.leto_factory = True  # type: ignore[attr-defined]  # strategy.py replaces only this


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_autoregister.install(register)
