"""Register ``"leto"`` with Lightning the moment ``lightning.pytorch`` is imported -- not before.

Why: Lightning has no plugin lookup for strategies, so ``Trainer(strategy="leto")`` works only
after ``StrategyRegistry.register("leto", ...)`` ran; but importing ``lightning.pytorch`` costs
about 5 s here, which ``import leto_lightning`` must not charge to processes that never train
with Lightning (the agent, the CLI, the simulator). This module imports nothing from
Lightning: it installs a ``sys.meta_path`` finder that lets the normal finders load
``lightning.pytorch`` and registers the strategy right after that package has executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any

TARGET = "lightning.pytorch"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of ``TARGET`` to run ``callback`` after it."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        spec = _real_spec(self, fullname, path, target)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        callback = self.callback

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            uninstall()
            callback()

        loader.exec_module = exec_then_register  # this spec's own loader instance
        return spec


def _real_spec(me: _AfterImport, fullname: str, path: Sequence[str] | None, target: Any) -> Any:
    for finder in sys.meta_path:
        if finder is me or isinstance(finder, _AfterImport):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, path, target) if find is not None else None
        if spec is not None:
            return spec
    return None


def install(callback: Callable[[], None]) -> bool:
    """Run ``callback`` now if Lightning is loaded, else right after it loads; False when
    Lightning is not installed (nothing to register with)."""
    if TARGET in sys.modules:
        callback()
        return True
    if importlib.util.find_spec("lightning") is None:
        return False
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(callback))
    return True


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
