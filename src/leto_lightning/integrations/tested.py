"""The versions of a framework an integration is tested with, refused outside them.

Why a hard check: the integrations rely on framework internals (Lightning's loops and checkpoint
connector, Accelerate's optimizer wrapper, scaler patching and state objects). A release that
changes one of them does not fail at import: it trains or resumes wrongly. So an untested
version is refused where a user first meets the integration (``Trainer(strategy="leto")``,
``LetoAccelerator(...)``), naming the version, the range and the fix. The ranges are pinned in
``pyproject.toml`` too (tests keep the two equal); ``LETO_ALLOW_UNTESTED_<FRAMEWORK>=1`` turns
the refusal into a warning, for trying a new release.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..errors import ConfigurationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TestedRange:
    """One framework's tested versions and what using another one risks."""

    package: str  # the distribution name, as pip spells it
    user: str  # the integration's entry point, for the message
    spec: str  # the tested range, as pyproject.toml pins it
    lowest: str
    highest: str
    allow_env: str
    risk: str  # why an untested version is refused
    error: type[ConfigurationError]  # what the refusal raises

    def installed(self) -> str:
        """The version of the package this process imports."""
        module = importlib.import_module(self.package)
        return str(getattr(module, "__version__", None) or metadata.version(self.package))

    def check(self, version: str | None = None) -> None:
        """Raise ``error`` unless ``version`` (default: the installed one) is in the range; with
        ``allow_env=1`` in the environment log a warning instead."""
        found = version if version is not None else self.installed()
        try:
            ok = Version(found) in SpecifierSet(self.spec)
        except InvalidVersion:
            ok = False
        if ok:
            return
        message = (f"{self.user} is tested with {self.package} {self.spec} ({self.lowest} to {self.highest}); "
                   f"found {self.package} {found}. {self.risk} Install a tested one: pip install "
                   f"'{self.package}{self.spec}' (or set {self.allow_env}=1 to try this version at your own risk)")
        if os.environ.get(self.allow_env) == "1":
            logger.warning("%s -- continuing because %s=1", message, self.allow_env)
            return
        raise self.error(message)
