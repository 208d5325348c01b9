"""Named fault-injection points.

Code on the recovery-critical path calls ``point("chunk.after_math", chunk=c)`` between
sub-steps. Normally that is one global lookup and a ``None`` check; a test, benchmark or the
demo installs a hook that decides whether to fail there -- e.g. tell a parent process where
the child stands and block until the parent SIGKILLs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class FaultHook(Protocol):
    def __call__(self, name: str, context: dict) -> None: ...


_hook: FaultHook | None = None


def point(name: str, **context: object) -> None:
    """An injection point. Must stay cheap: it sits in per-chunk loops."""
    if _hook is not None:
        _hook(name, context)


def set_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install ``hook`` (None removes it); returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def get_hook() -> Callable | None:
    return _hook
