"""The Accelerate versions ``LetoAccelerator`` is tested with, checked when it is constructed.

It relies on Accelerate internals (``AcceleratedOptimizer.step`` and ``patch_optimizer_step``,
the scaler's step and skip rule, ``AcceleratorState``'s distributed type and the FSDP2 prepare
path, what ``save_state`` records), and a release changes them without an error: 1.16 made
``clip_grad_norm_`` under FSDP2 return a plain tensor instead of a DTensor. So an untested
version is refused at ``LetoAccelerator(...)`` (``integrations.tested``). CI runs the suite on
the highest version of the range and the Accelerate tests that lean on its internals the most on
the lowest (``.ci/run``).
"""

from __future__ import annotations

from ...env import ALLOW_UNTESTED_ACCELERATE
from ...errors import ConfigurationError
from ..tested import TestedRange

ACCELERATE_RANGE = ">=1.15.0,<1.17"  # lowest and highest tested: 1.15.0 and 1.16.0 (pyproject.toml pins the same)
LOWEST_TESTED = "1.15.0"
HIGHEST_TESTED = "1.16.0"
ALLOW_ENV = ALLOW_UNTESTED_ACCELERATE


class UntestedAccelerateError(ConfigurationError):
    """The installed Accelerate is outside the range ``LetoAccelerator`` is tested with."""


TESTED = TestedRange("accelerate", "LetoAccelerator", ACCELERATE_RANGE, LOWEST_TESTED, HIGHEST_TESTED, ALLOW_ENV,
                     "It depends on Accelerate internals that change between releases, so an untested version could "
                     "train or resume differently from Accelerator.", UntestedAccelerateError)


def check_accelerate(version: str | None = None) -> None:
    """Raise ``UntestedAccelerateError`` unless ``version`` (default: the installed one) is in
    ``ACCELERATE_RANGE``; with ``LETO_ALLOW_UNTESTED_ACCELERATE=1`` log a warning instead."""
    TESTED.check(version)
