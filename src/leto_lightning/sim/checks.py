"""Input validation shared by the simulator's dataclasses.

Every failed check raises ``ConfigurationError`` (``leto_lightning.errors``, a ``ValueError``)
whose message starts with ``name=value``, so a bad recipe field, CLI flag or override is named in
the error the user sees.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from leto_lightning.errors import ConfigurationError


def fail(name: str, value: Any, why: str) -> NoReturn:
    """Raise the simulator's standard error for one offending value."""
    raise ConfigurationError(f"{name}={value!r} {why}")


def require(ok: bool, name: str, value: Any, why: str) -> None:
    """Raise ``ConfigurationError('name=value why')`` unless ``ok``."""
    if not ok:
        fail(name, value, why)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive(name: str, value: Any) -> None:
    """A finite number > 0."""
    require(_is_number(value) and math.isfinite(value) and value > 0, name, value,
            "must be a finite number > 0")


def non_negative(name: str, value: Any) -> None:
    """A finite number >= 0."""
    require(_is_number(value) and math.isfinite(value) and value >= 0, name, value,
            "must be a finite number >= 0")


def fraction(name: str, value: Any) -> None:
    """A number in [0, 1]."""
    require(_is_number(value) and 0.0 <= value <= 1.0, name, value, "must be in [0, 1]")


def int_at_least(name: str, value: Any, low: int) -> None:
    """An integer (not a bool) >= ``low``."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
            name, value, f"must be an integer >= {low}")
