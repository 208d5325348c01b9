"""``fit_loop.state_dict()`` at a fraction of its cost, checked against Lightning's own.

Why: a payload holds the fit loop's state, and two payloads are captured per step. Lightning's
``_Loop.state_dict`` turns every progress counter into a dict with ``dataclasses.asdict``, whose
generic recursion and deep copies cost about half of a capture. The progress objects are flat
dataclasses of ints, bools and nested progress objects, so their fields can be read directly.

Why it is safe: the first time a given loop is captured, the fast result is compared with
``loop.state_dict()``; if they differ in anything (another Lightning, a custom loop or progress
class) Lightning's own method is used for that loop from then on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from typing import Any

from .internals import BaseProgress, Loop

logger = logging.getLogger(__name__)

_FIELDS: dict[type, tuple[str, ...]] = {}
_CHECKED: weakref.WeakKeyDictionary[Loop, bool] = weakref.WeakKeyDictionary()  # loop -> fast path agrees
_SCALARS = (int, float, bool, str, type(None))


def loop_state_dict(loop: Loop) -> dict[str, Any]:
    """What ``loop.state_dict()`` returns (module doc)."""
    agrees = _CHECKED.get(loop)
    if agrees is None:
        fast, real = _fast(loop), loop.state_dict()
        try:
            agrees = _CHECKED[loop] = bool(fast == real)
        except (RuntimeError, ValueError):  # tensors in a loader's state: no plain comparison
            agrees = _CHECKED[loop] = False
        if not agrees:
            logger.debug("loop state of %s: the fast path differs from Lightning's; using Lightning's", type(loop))
        return real
    return _fast(loop) if agrees else loop.state_dict()


def _fast(loop: Loop, destination: dict[str, Any] | None = None, prefix: str = "") -> dict[str, Any]:
    """``Loop.state_dict``'s traversal, with progress objects read field by field."""
    if type(loop).state_dict is not Loop.state_dict:  # a loop with its own state_dict: its own
        out = loop.state_dict()
        if destination is not None:
            destination.update({prefix + k: v for k, v in out.items()})
        return out
    destination = {} if destination is None else destination
    destination[prefix + "state_dict"] = loop.on_save_checkpoint()
    for key, value in loop.__dict__.items():
        if isinstance(value, BaseProgress):
            destination[prefix + key] = _progress(value)
        elif isinstance(value, Loop):
            _fast(value, destination, prefix + key + ".")
    return destination


def _progress(obj: Any) -> Any:
    """``dataclasses.asdict`` for progress objects (scalars copied as they are)."""
    if type(obj) in _SCALARS:
        return obj
    if not dataclasses.is_dataclass(obj):
        return copy.deepcopy(obj)
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: _progress(getattr(obj, name)) for name in names}
