"""``LetoAccelerator`` with a ``ZeroRedundancyOptimizer`` (ZeRO-1 over DDP) passed to ``prepare()``.

Accelerate 1.15's ``AcceleratedOptimizer`` round-trips ``state_dict()`` at prepare when it places
the optimizer on the device, and a ``ZeroRedundancyOptimizer`` refuses ``state_dict()`` before a
collective ``consolidate_state_dict()`` (a plain ``Accelerator`` fails there too); its state is
still empty then, so ``LetoAccelerator`` prepares it without device placement (on CPU nothing
moves). After the DDP wrap the optimizer binds through ``updater.zero1``: each rank's store holds
the params it owns, their grads and optimizer state; a continuation (``LETO_RESUME=retained``
after ``recover_node``) attaches and refreshes every replica from its owner right away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ...env import ProcessSettings
from ...errors import ConfigurationError
from ...retained.config import RetainedConfig
from ...runtime.engine import RankPlace
from ...updater.zero1 import RetainedZeRO1, attach_zero1, create_zero1


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def bind(zero: ZeroRedundancyOptimizer, config: RetainedConfig, job: str, place: RankPlace, continuing: bool,
         barrier: Callable[[], None] | None, payload_fn: Callable[[], Any], names: dict, *,
         under_launcher: bool, rollback_window: bool) -> RetainedZeRO1:
    """A new store (fresh start) or this rank's existing one, views only until ``resume()``."""
    if rollback_window:
        raise ConfigurationError("LetoAccelerator: rollback_window with a ZeroRedundancyOptimizer is not supported; "
                                 "use LetoConfig(rollback_window=False) or a plain torch.optim optimizer")
    if under_launcher:
        raise ConfigurationError("ZeroRedundancyOptimizer under `leto launch` (shadows, promotion) is not supported "
                                 "yet: start the ranks with torchrun / accelerate launch, or use a plain torch.optim "
                                 "optimizer")
    if continuing:
        # The owned params take the store's values (resume() follows in the accelerator); the
        # replicas come from their owners now, before the first forward.
        return attach_zero1(zero, job_id=job, barrier=barrier, payload_fn=payload_fn, names=names, resume=False,
                            settings=ProcessSettings.from_env())
    return create_zero1(zero, config, job_id=job, local_rank=place.local_rank, n_local=place.local_world_size,
                        node=place.node, barrier=barrier, payload_fn=payload_fn, names=names,
                        settings=ProcessSettings.from_env())
