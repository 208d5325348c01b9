"""The ``ckpt_path`` that resumes a Lightning fit from retained memory, and the runtime options.

``LetoRuntimeOptions`` is neutral to the trainer library and lives in ``runtime/options.py``
(the Accelerate integration uses it too); it is named here as well because
``leto_lightning.integrations.lightning`` exports it with ``LetoStrategy``.
"""

from __future__ import annotations

from ...runtime.options import LetoRuntimeOptions

RETAINED_CKPT = "leto://retained"  # ``trainer.fit(ckpt_path=...)``: resume from retained memory

__all__ = ["RETAINED_CKPT", "LetoRuntimeOptions"]
