"""The tested Lightning range: refused outside it at ``Trainer(strategy="leto")``, with a message
that names the version found, the range and what to do; pinned the same in pyproject.toml."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
import tomllib
from packaging.requirements import Requirement

from leto_lightning.errors import ConfigurationError
from leto_lightning.integrations.lightning import versions
from leto_lightning.integrations.lightning.versions import UntestedLightningError, check_lightning

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize("version", ["2.6.0", "2.6.6", "2.6.7"])
def test_tested_range_accepted(version: str) -> None:
    check_lightning(version)


@pytest.mark.parametrize("version", ["2.4.0", "2.5.6", "2.7.0", "3.0.0", "not-a-version"])
def test_outside_the_range_refused_naming_version_range_and_fix(version: str, monkeypatch) -> None:
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(UntestedLightningError) as err:
        check_lightning(version)
    text = str(err.value)
    assert f"found lightning {version}" in text and versions.LIGHTNING_RANGE in text
    assert f"pip install 'lightning{versions.LIGHTNING_RANGE}'" in text and versions.ALLOW_ENV in text
    assert isinstance(err.value, ConfigurationError)


def test_trainer_construction_refuses_an_untested_lightning(monkeypatch) -> None:
    """The check runs where a user meets it: building the Trainer, before any fit."""
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.setattr(lightning, "__version__", "2.5.6")
    with pytest.raises(UntestedLightningError, match="found lightning 2.5.6"):
        pl.Trainer(strategy="leto", accelerator="cpu", devices=1, logger=False)


def test_override_warns_instead(monkeypatch, caplog) -> None:
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="leto_lightning.integrations.tested"):
        check_lightning("2.7.1")
    assert "found lightning 2.7.1" in caplog.text and f"{versions.ALLOW_ENV}=1" in caplog.text


def test_installed_version_is_tested_and_pyproject_pins_the_same_range() -> None:
    check_lightning()  # this environment's Lightning is one the range covers
    project = tomllib.loads(PYPROJECT.read_text())["project"]  # Lightning is an extra ([lightning], [demo], [test])
    deps = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    pins = [Requirement(d) for d in deps if Requirement(d).name == "lightning"]
    assert pins and "lightning" in project["optional-dependencies"]
    for pin in pins:
        assert str(pin.specifier) == str(Requirement(f"lightning{versions.LIGHTNING_RANGE}").specifier)
        assert versions.LOWEST_TESTED in pin.specifier and versions.HIGHEST_TESTED in pin.specifier
