"""The tested Accelerate range: refused outside it at ``LetoAccelerator(...)``, with a message
that names the version found, the range and what to do; pinned the same in pyproject.toml."""

from __future__ import annotations

import logging
from pathlib import Path

import accelerate
import pytest
import tomllib
from packaging.requirements import Requirement

from leto_lightning.accelerate import LetoAccelerator
from leto_lightning.errors import ConfigurationError
from leto_lightning.integrations.accelerate import versions
from leto_lightning.integrations.accelerate.versions import UntestedAccelerateError, check_accelerate

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize("version", ["1.15.0", "1.16.0", "1.16.2"])
def test_tested_range_accepted(version: str) -> None:
    check_accelerate(version)


@pytest.mark.parametrize("version", ["1.0.0", "1.14.0", "1.17.0", "2.0.0", "not-a-version"])
def test_outside_the_range_refused_naming_version_range_and_fix(version: str, monkeypatch) -> None:
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(UntestedAccelerateError) as err:
        check_accelerate(version)
    text = str(err.value)
    assert f"found accelerate {version}" in text and versions.ACCELERATE_RANGE in text
    assert f"pip install 'accelerate{versions.ACCELERATE_RANGE}'" in text and versions.ALLOW_ENV in text
    assert isinstance(err.value, ConfigurationError)


def test_construction_refuses_an_untested_accelerate(monkeypatch) -> None:
    """The check runs where a user meets it: building the accelerator, before anything else."""
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.setattr(accelerate, "__version__", "1.14.0")
    with pytest.raises(UntestedAccelerateError, match="found accelerate 1.14.0"):
        LetoAccelerator(cpu=True)


def test_override_warns_instead(monkeypatch, caplog) -> None:
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="leto_lightning.integrations.tested"):
        check_accelerate("1.17.1")
    assert "found accelerate 1.17.1" in caplog.text and f"{versions.ALLOW_ENV}=1" in caplog.text


def test_installed_version_is_tested_and_pyproject_pins_the_same_range() -> None:
    check_accelerate()
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    deps = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    pins = [Requirement(d) for d in deps if Requirement(d).name == "accelerate"]
    assert pins and "accelerate" in project["optional-dependencies"]
    for pin in pins:
        assert str(pin.specifier) == str(Requirement(f"accelerate{versions.ACCELERATE_RANGE}").specifier)
        assert versions.LOWEST_TESTED in pin.specifier and versions.HIGHEST_TESTED in pin.specifier
