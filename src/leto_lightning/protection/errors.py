"""Exceptions of the protection layer (the family is defined in ``leto_lightning.errors``).

Recovery code catches ``ProtectionError`` (or its parent ``RetainedStateError``) to fall back to
the last checkpoint: more damage than the parity covers must be *reported*, never silently
repaired wrong.
"""

from __future__ import annotations

from ..errors import ConfigurationError, ProtectionError

__all__ = ["EngineUnavailableError", "NoInverseError", "PageTypeError", "ParityExhaustedError"]


class ParityExhaustedError(ProtectionError):
    """More pages were lost than surviving parity pages can rebuild."""

    def __init__(self, lost: int, surviving_parity: int, detail: str = "") -> None:
        self.lost = lost
        self.surviving_parity = surviving_parity
        msg = (
            f"cannot rebuild {lost} lost data page(s): only {surviving_parity} parity "
            f"page(s) survive (each lost page needs one)"
        )
        super().__init__(f"{msg}; {detail}" if detail else msg)


class EngineUnavailableError(ProtectionError, ConfigurationError):
    """A named erasure engine cannot be loaded on this machine (choose another engine)."""


class PageTypeError(ConfigurationError, TypeError):
    """A page argument is not a contiguous uint8 tensor (or not on a device the engine reads)."""


class NoInverseError(ConfigurationError, ZeroDivisionError):
    """A GF(2^8) element without a multiplicative inverse (0, or not a field element)."""
