"""leto-lightning: in-place recovery from hardware-operable failures in LLM training.

What users import (``__all__``; docs/design.md section 2)::

    from leto_lightning import LetoStrategy                  # Trainer(strategy="leto") also works
    from leto_lightning.accelerate import LetoAccelerator, LetoConfig
    import leto_lightning.runtime as leto                    # plain PyTorch: session = leto.init()
    from leto_lightning import RetainedConfig, RetainedOptimizer, RetainedStore, recover_node
    from leto_lightning import LetoError, ConfigurationError, RetainedStateError   # the errors

Parts: ``retained`` (paged retained memory, store, progress record), ``protection`` (pure
coding: GF(2^8), Reed-Solomon, engines, checksums), ``updater`` (chunk transactions, repair,
recovery), ``runtime`` (launcher, agent, detection, classification, and the shadow trainers:
shadows live in the runtime, not in a package of their own), ``integrations`` (Lightning,
Accelerate), ``sim`` (large-scale simulator), ``models`` (the compact MoE transformer),
``faults`` (injection points and injectors), ``testing`` (crash harnesses, for tests),
``demos`` (``leto demo``).

Importing the package is cheap: everything but the errors loads on first use (the Lightning and
Accelerate names import Lightning or Accelerate). ``Trainer(strategy="leto")`` is registered the
moment ``lightning.pytorch`` is imported, before or after this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigurationError,
    IncompleteStoreError,
    InternalError,
    LetoError,
    LetoTimeoutError,
    MissingExtraError,
    ProtectionError,
    RecoveryError,
    RetainedStateError,
    UnrecoverableDamageError,
    UsageError,
)

# Trainer(strategy="leto"): registered as soon as lightning.pytorch is imported (lazy; costs nothing
# without Lightning).
from .integrations import lightning as _lightning_integration  # noqa: F401

__version__ = "0.1.0"

_LAZY = {  # public name -> the module that defines it (imported on first access)
    "LetoStrategy": "leto_lightning.integrations.lightning.strategy",
    "LetoLoopStateCallback": "leto_lightning.integrations.lightning.callback",
    "ResumableDataLoader": "leto_lightning.integrations.lightning.data",
    "LetoAccelerator": "leto_lightning.integrations.accelerate",
    "LetoConfig": "leto_lightning.integrations.accelerate",
    "RetainedConfig": "leto_lightning.retained.config",
    "RetainedStore": "leto_lightning.retained.store",
    "RetainedOptimizer": "leto_lightning.updater.retained_optimizer",
    "encode_tier2": "leto_lightning.updater.store_setup",
    "ParityCodes": "leto_lightning.updater.transaction",
    "recover_node": "leto_lightning.updater.recovery",
    "unlink_segments": "leto_lightning.retained.shm",
}

__all__ = [  # the errors (loaded with the package) and the lazy names of _LAZY
    "ConfigurationError",
    "IncompleteStoreError",
    "InternalError",
    "LetoAccelerator",
    "LetoConfig",
    "LetoError",
    "LetoLoopStateCallback",
    "LetoStrategy",
    "LetoTimeoutError",
    "MissingExtraError",
    "ParityCodes",
    "ProtectionError",
    "RecoveryError",
    "ResumableDataLoader",
    "RetainedConfig",
    "RetainedOptimizer",
    "RetainedStateError",
    "RetainedStore",
    "UnrecoverableDamageError",
    "UsageError",
    "__version__",
    "encode_tier2",
    "new_job_id",
    "recover_node",
    "unlink_segments",
]

if TYPE_CHECKING:
    from .integrations.accelerate import LetoAccelerator, LetoConfig
    from .integrations.lightning.callback import LetoLoopStateCallback
    from .integrations.lightning.data import ResumableDataLoader
    from .integrations.lightning.strategy import LetoStrategy
    from .retained.config import RetainedConfig
    from .retained.shm import unlink_segments
    from .retained.store import RetainedStore
    from .updater.recovery import recover_node
    from .updater.retained_optimizer import RetainedOptimizer
    from .updater.store_setup import encode_tier2
    from .updater.transaction import ParityCodes


def new_job_id() -> str:
    """A new random job id, starting with ``LETO_JOB_PREFIX`` when that is set
    (``retained.shm.new_job_id`` with ``env.job_prefix()``)."""
    from .env import job_prefix
    from .retained.shm import new_job_id as new_id

    return new_id(job_prefix())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
