"""Accelerate integration: ``LetoAccelerator`` and ``LetoConfig`` (docs/accelerate.md).

Importing it imports ``accelerate``; nothing else in the package does.
"""

from __future__ import annotations

from .accelerator import LetoAccelerator
from .config import LetoConfig
from .payload import ResumePoint

__all__ = ["LetoAccelerator", "LetoConfig", "ResumePoint"]
