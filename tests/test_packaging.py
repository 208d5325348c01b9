"""What a user installs is what the package needs: the core and the simulator run without the extras.

``pyproject.toml`` keeps the core's dependencies minimal (torch, numpy, omegaconf, pyyaml,
pyeclib); Lightning, Accelerate, plots, the demo's tables, wandb, TensorBoard and NVML come with
extras. Installing a fresh environment per extra takes minutes of pip, so instead one
interpreter hides the optional packages from the import system (a ``sys.meta_path`` wrapper:
for them every finder answers "not found", as when they are not installed) and imports every
module of the core there. A command that needs an extra must say which one.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

import leto_lightning
import leto_lightning.demos
import leto_lightning.faults
import leto_lightning.testing

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("wandb", "matplotlib", "rich", "tensorboard", "tensorboardX", "lightning", "pytorch_lightning",
            "accelerate", "pynvml")
CORE = ("leto_lightning.errors", "leto_lightning.console", "leto_lightning.extras", "leto_lightning.faults",
        "leto_lightning.retained", "leto_lightning.protection", "leto_lightning.updater", "leto_lightning.runtime",
        "leto_lightning.sim", "leto_lightning.models.config", "leto_lightning.testing.crash", "leto_lightning.train",
        "leto_lightning.cli", "leto_lightning.demos")
SCRIPTS_NEEDING = {"leto_lightning.sim.plots": "sim"}  # python -m scripts whose whole job needs an extra

_WITHOUT_EXTRAS = r"""
import importlib, json, pkgutil, sys

HIDDEN = set(sys.argv[1].split(","))


class Hidden:
    '''A finder that does not find the hidden packages (as if not installed), else asks the real one.'''

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
failed = {}
for root in sys.argv[2].split(","):
    module = importlib.import_module(root)
    names = [root] + [m.name for m in pkgutil.walk_packages(getattr(module, "__path__", []), root + ".")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
from leto_lightning import cli

code = cli.main(["demo", "--core"])  # needs rich ([demo]): refused in one line before any work
loaded = sorted({m.partition(".")[0] for m in sys.modules} & HIDDEN)
print(json.dumps({"failed": failed, "loaded": loaded, "demo_exit": code}))
"""


def test_core_and_simulator_import_without_the_extras() -> None:
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, ",".join(OPTIONAL), ",".join(CORE)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = result["failed"]
    for script, extra in SCRIPTS_NEEDING.items():  # may need its extra, but must say which
        if script in failed:
            assert f'leto-lightning[{extra}]' in failed.pop(script), script
    assert failed == {}, failed
    assert result["loaded"] == []  # nothing optional got in through a side door
    assert result["demo_exit"] == 1
    assert 'needs \'rich\'' in proc.stderr and 'pip install "leto-lightning[demo]"' in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_import_is_cheap_and_the_public_names_resolve() -> None:
    heavy = "{'torch', 'lightning', 'accelerate', 'numpy'}"
    probe = f"import sys, leto_lightning; print(sorted({{m.partition('.')[0] for m in sys.modules}} & {heavy}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    for package in (leto_lightning, leto_lightning.faults, leto_lightning.testing, leto_lightning.demos):
        assert len(set(package.__all__)) == len(package.__all__), package.__name__
        for name in package.__all__:  # a name, or a submodule (testing's harnesses load on demand)
            value = getattr(package, name, None) or importlib.import_module(f"{package.__name__}.{name}")
            assert value is not None, (package.__name__, name)
    assert set(leto_lightning.__all__) <= set(dir(leto_lightning))


def test_extras_cover_what_the_commands_need() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {Requirement(d).name for d in project["dependencies"]}
    assert not core & {"wandb", "matplotlib", "rich", "tensorboard", "lightning", "accelerate", "nvidia-ml-py"}, core
    extras = {name: {Requirement(d).name for d in reqs} for name, reqs in project["optional-dependencies"].items()}
    assert {"lightning", "accelerate", "sim", "demo", "cuda", "test"} <= set(extras)
    assert set().union(*(reqs for name, reqs in extras.items() if name != "test")) <= extras["test"]
    readme = (ROOT / "README.md").read_text()
    assert 'pip install torch==2.13.0 -e ".[demo]" && leto demo' in readme  # the README's two commands
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q' in readme
