"""Every module of the package imports on its own, first thing in a fresh interpreter.

Why: the Lightning integration registers ``"leto"`` from an import hook that fires when
``lightning.pytorch`` finishes loading -- which can be in the middle of importing one of the
package's own modules. A module that works only when something else was imported before it
passes every test that happens to import in the "right" order, and fails for a user who
writes ``import leto_lightning.integrations.lightning.callback``.

Cheap: one interpreter preloads torch and other slow third-party imports (no Lightning, nothing of
this package) and forks one child per module; each child starts with only the standard library and torch in
``sys.modules`` (plus those) and imports its module first.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_WALK = r"""
import importlib, importlib.util, json, os, sys, traceback
import torch, torch._dynamo, torch.distributed, torch.fx.experimental.symbolic_shapes, torch.utils.tensorboard
import torchmetrics  # the slow part of every import, preloaded: nothing of Lightning or leto_lightning
try:
    import matplotlib.pyplot
except ImportError:
    pass
assert not any(m == "lightning" or m.startswith(("lightning.", "leto_lightning")) for m in sys.modules)
root = importlib.util.find_spec("leto_lightning").submodule_search_locations[0]  # not executed
modules = []
for here, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    package = "leto_lightning" + here[len(root):].replace(os.sep, ".")
    for name in sorted(files):
        if name.endswith(".py"):
            modules.append(package if name == "__init__.py" else f"{package}.{name[:-3]}")
failures = {}
import tempfile
report = os.path.join(tempfile.mkdtemp(), "failure")
for module in modules:
    pid = os.fork()
    if pid == 0:
        message = ""
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # an optional third-party dependency is not installed
            if not exc.name or exc.name.startswith("leto_lightning"):
                message = traceback.format_exc()
        except BaseException:
            message = traceback.format_exc()
        if message:
            with open(report, "w") as f:
                f.write(message[-3000:])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.path.exists(report):
        with open(report) as f:
            failures[module] = f.read()
        os.unlink(report)
    elif status != 0:
        failures[module] = f"child ended with wait status {status}"
os.rmdir(os.path.dirname(report))
print(json.dumps({"modules": modules, "failures": failures}))
"""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    result = subprocess.run([sys.executable, "-c", _WALK], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "leto_lightning.integrations.lightning.callback" in out["modules"]
    assert len(out["modules"]) > 50, out["modules"]
    assert not out["failures"], "\n".join(f"{m}:\n{tb}" for m, tb in out["failures"].items())


@pytest.mark.parametrize("integration", ["lightning", "accelerate"])
def test_every_checkpoint_load_in_the_integration_is_weights_only(integration: str) -> None:
    """``torch.load`` / ``checkpoint_io.load_checkpoint`` in ``integrations/lightning`` and
    ``integrations/accelerate`` pass ``weights_only=True``: a checkpoint is data, never code
    (``super().load_checkpoint`` passes Lightning's own argument through)."""
    import ast
    import importlib
    import pathlib

    package = importlib.import_module(f"leto_lightning.integrations.{integration}")
    calls = []
    for path in sorted(pathlib.Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            is_super = isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"
            if (node.func.attr == "load" and getattr(owner, "id", None) == "torch") or (
                    node.func.attr == "load_checkpoint" and not is_super):
                flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                calls.append((path.name, node.lineno, getattr(flag, "value", None)))
    assert calls, "no checkpoint loads found: the check looks at the wrong files"
    assert all(flag is True for _, _, flag in calls), calls
