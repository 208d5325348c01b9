"""The Lightning versions ``LetoStrategy`` is tested with, checked when it is constructed.

It relies on Lightning internals (the checkpoint connector's ``_select_ckpt_path``,
``Trainer._fit_impl``, the loops' ``state_dict`` keys and progress counters,
``_should_accumulate``, logger internals, ...), so an untested version is refused at
``Trainer(strategy="leto")`` (``integrations.tested``). CI runs the Lightning tests on the
highest version of the range and a fast subset on the lowest (``.ci/run``).
"""

from __future__ import annotations

from ...env import ALLOW_UNTESTED_LIGHTNING
from ...errors import ConfigurationError
from ..tested import TestedRange

LIGHTNING_RANGE = ">=2.6.0,<2.7"  # lowest and highest tested: 2.6.0 and 2.6.6 (pyproject.toml pins the same)
LOWEST_TESTED = "2.6.0"
HIGHEST_TESTED = "2.6.6"
ALLOW_ENV = ALLOW_UNTESTED_LIGHTNING


class UntestedLightningError(ConfigurationError):
    """The installed Lightning is outside the range ``LetoStrategy`` is tested with."""


TESTED = TestedRange("lightning", "LetoStrategy", LIGHTNING_RANGE, LOWEST_TESTED, HIGHEST_TESTED, ALLOW_ENV,
                     "It depends on Lightning internals that change between releases, so an untested version could "
                     "resume training wrongly.", UntestedLightningError)


def check_lightning(version: str | None = None) -> None:
    """Raise ``UntestedLightningError`` unless ``version`` (default: the installed one) is in
    ``LIGHTNING_RANGE``; with ``LETO_ALLOW_UNTESTED_LIGHTNING=1`` log a warning instead."""
    TESTED.check(version)
