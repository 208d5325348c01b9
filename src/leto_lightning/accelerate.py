"""``from leto_lightning.accelerate import LetoAccelerator, LetoConfig`` (docs/accelerate.md).

``LetoAccelerator`` is a drop-in for ``accelerate.Accelerator`` whose optimizer state lives in
retained memory and whose workers recover in place; start the script with ``accelerate launch
--config_file configs/accelerate/leto.yaml train.py``, ``leto launch``, ``torchrun`` or ``python``.
"""

from __future__ import annotations

from .integrations.accelerate import LetoAccelerator, LetoConfig, ResumePoint

__all__ = ["LetoAccelerator", "LetoConfig", "ResumePoint"]
