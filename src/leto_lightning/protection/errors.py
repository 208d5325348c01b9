"""Exceptions of the protection layer.

Recovery code catches ``ProtectionError`` to fall back to the last checkpoint: more
damage than the parity covers must be *reported*, never silently repaired wrong.
"""

from __future__ import annotations


class ProtectionError(RuntimeError):
    """Base class: retained state could not be protected or repaired."""


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


class EngineUnavailableError(ProtectionError):
    """A named erasure engine cannot be loaded on this machine."""
