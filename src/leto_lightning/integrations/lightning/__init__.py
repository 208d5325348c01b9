"""Lightning integration: ``Trainer(strategy="leto")`` (DESIGN.md section 2.6).

Importing this package registers the ``"leto"`` strategy name with Lightning's
``StrategyRegistry`` (once; importing again is harmless). Lightning has no plugin lookup for
strategies, so the name exists only after this import -- ``import leto_lightning`` performs it
when Lightning is installed.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .callback import LetoLoopStateCallback
from .data import ResumableDataLoader
from .options import RETAINED_CKPT, LetoRuntimeOptions
from .strategy import STRATEGY_NAME, LetoStrategy


def register() -> None:
    """Make ``Trainer(strategy="leto")`` work (idempotent)."""
    LetoStrategy.register_strategies(StrategyRegistry)


register()

__all__ = ["LetoStrategy", "LetoLoopStateCallback", "LetoRuntimeOptions", "ResumableDataLoader",
           "RETAINED_CKPT", "STRATEGY_NAME", "register"]
