"""Lightning integration: ``Trainer(strategy="leto")`` (DESIGN.md section 2.6).

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
__all__ = [*_EXPORTS, "register"]


def register() -> None:
    """Register ``"leto"`` with ``lightning.pytorch``'s ``StrategyRegistry`` (idempotent)."""
    loading = sys.modules.get(f"{__name__}.strategy")
    if loading is not None and not hasattr(loading, "LetoStrategy"):
        return  # strategy.py itself is importing Lightning; it registers when it is complete
    from lightning.pytorch.strategies import StrategyRegistry

    from .strategy import LetoStrategy

    LetoStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_autoregister.install(register)
