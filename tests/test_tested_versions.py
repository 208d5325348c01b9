"""The tested Lightning and Accelerate ranges: refused outside them where a user first meets the
integration (``Trainer(strategy="leto")``, ``LetoAccelerator(...)``), with a message that names
the version found, the range and what to do; pinned the same in pyproject.toml."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from leto_lightning.errors import ConfigurationError
from leto_lightning.integrations import tested as tested_ranges
from leto_lightning.integrations.accelerate import versions as accelerate_versions
from leto_lightning.integrations.lightning import versions as lightning_versions

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# per framework: its range, versions inside it, versions outside it
CASES = {
    "lightning": (lightning_versions.TESTED, ["2.6.0", "2.6.6", "2.6.7"], ["2.4.0", "2.5.6", "2.7.0", "3.0.0", "x"]),
    "accelerate": (accelerate_versions.TESTED, ["1.15.0", "1.16.0", "1.16.2"], ["1.0.0", "1.14.0", "1.17.0", "x"]),
}


def _cases(which: int) -> list:
    return [pytest.param(tested, v, id=f"{name}-{v}") for name, (tested, *lists) in CASES.items() for v in lists[which]]


@pytest.mark.parametrize("tested,version", _cases(0))
def test_tested_range_accepted(tested: tested_ranges.TestedRange, version: str) -> None:
    tested.check(version)


@pytest.mark.parametrize("tested,version", _cases(1))
def test_outside_the_range_refused_naming_version_range_and_fix(tested: tested_ranges.TestedRange, version: str,
                                                                monkeypatch) -> None:
    monkeypatch.delenv(tested.allow_env, raising=False)
    with pytest.raises(tested.error) as err:
        tested.check(version)
    text = str(err.value)
    assert f"found {tested.package} {version}" in text and tested.spec in text and tested.user in text
    assert f"pip install '{tested.package}{tested.spec}'" in text and tested.allow_env in text
    assert isinstance(err.value, ConfigurationError)


@pytest.mark.parametrize("name", CASES)
def test_construction_refuses_an_untested_version(name: str, monkeypatch) -> None:
    """The check runs where a user meets it: building the Trainer or the accelerator."""
    tested = CASES[name][0]
    monkeypatch.delenv(tested.allow_env, raising=False)
    if name == "lightning":
        import lightning
        import lightning.pytorch as pl

        monkeypatch.setattr(lightning, "__version__", "2.5.6")
        with pytest.raises(tested.error, match="found lightning 2.5.6"):
            pl.Trainer(strategy="leto", accelerator="cpu", devices=1, logger=False)
    else:
        import accelerate

        from leto_lightning.accelerate import LetoAccelerator

        monkeypatch.setattr(accelerate, "__version__", "1.14.0")
        with pytest.raises(tested.error, match="found accelerate 1.14.0"):
            LetoAccelerator(cpu=True)


@pytest.mark.parametrize("name", CASES)
def test_override_warns_instead(name: str, monkeypatch, caplog) -> None:
    tested = CASES[name][0]
    monkeypatch.setenv(tested.allow_env, "1")
    with caplog.at_level(logging.WARNING, logger="leto_lightning.integrations.tested"):
        tested.check("9.9.9")
    assert f"found {tested.package} 9.9.9" in caplog.text and f"{tested.allow_env}=1" in caplog.text


@pytest.mark.parametrize("name", CASES)
def test_installed_version_is_tested_and_pyproject_pins_the_same_range(name: str) -> None:
    tested = CASES[name][0]
    tested.check()  # this environment's version is one the range covers (CI: the highest, then the lowest)
    project = tomllib.loads(PYPROJECT.read_text())["project"]  # both are extras ([lightning], [accelerate], [test])
    deps = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    pins = [Requirement(d) for d in deps if Requirement(d).name == name]
    assert pins and name in project["optional-dependencies"]
    for pin in pins:
        assert str(pin.specifier) == str(Requirement(f"{name}{tested.spec}").specifier)
        assert tested.lowest in pin.specifier and tested.highest in pin.specifier
