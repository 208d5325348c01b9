"""Fault injection: named points in the code and the injectors tests and demos use."""

from .points import point, set_hook

__all__ = ["point", "set_hook"]
