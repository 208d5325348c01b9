"""The Lightning versions ``LetoStrategy`` is tested with, checked when it is constructed.

Why a hard check: the integration relies on Lightning internals (the checkpoint connector's
``_select_ckpt_path``, ``Trainer._fit_impl``, the loops' ``state_dict`` keys and progress
counters, ``_should_accumulate``, logger internals, ...). A Lightning release that changes one of
them does not fail at import: it resumes wrongly. So an untested version is refused at
``Trainer(strategy="leto")``, naming the version and the range, before anything runs.

The range is pinned in ``pyproject.toml`` too (a test keeps the two equal); CI runs the Lightning
tests on the highest version of the range and a fast subset on the lowest (``.ci/run``).
``LETO_ALLOW_UNTESTED_LIGHTNING=1`` turns the refusal into a warning, for trying a new release.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ...errors import ConfigurationError
from ...runtime.contract import ALLOW_UNTESTED_LIGHTNING

logger = logging.getLogger(__name__)

LIGHTNING_RANGE = ">=2.6.0,<2.7"  # lowest and highest tested: 2.6.0 and 2.6.6 (pyproject.toml pins the same)
LOWEST_TESTED = "2.6.0"
HIGHEST_TESTED = "2.6.6"
ALLOW_ENV = ALLOW_UNTESTED_LIGHTNING


class UntestedLightningError(ConfigurationError):
    """The installed Lightning is outside the range ``LetoStrategy`` is tested with."""


def installed_lightning() -> str:
    """The version of the ``lightning`` package this process imports."""
    import lightning

    return str(getattr(lightning, "__version__", None) or metadata.version("lightning"))


def check_lightning(version: str | None = None) -> None:
    """Raise ``UntestedLightningError`` unless ``version`` (default: the installed one) is in
    ``LIGHTNING_RANGE``; with ``LETO_ALLOW_UNTESTED_LIGHTNING=1`` log a warning instead."""
    found = version if version is not None else installed_lightning()
    try:
        ok = Version(found) in SpecifierSet(LIGHTNING_RANGE)
    except InvalidVersion:
        ok = False
    if ok:
        return
    message = (f"LetoStrategy is tested with lightning {LIGHTNING_RANGE} ({LOWEST_TESTED} to {HIGHEST_TESTED}); "
               f"found lightning {found}. It depends on Lightning internals that change between releases, so an "
               f"untested version could resume training wrongly. Install a tested one: pip install "
               f"'lightning{LIGHTNING_RANGE}' (or set {ALLOW_ENV}=1 to try this version at your own risk)")
    if os.environ.get(ALLOW_ENV) == "1":
        logger.warning("%s -- continuing because %s=1", message, ALLOW_ENV)
        return
    raise UntestedLightningError(message)
