"""Below ``runtime/`` nothing reads the process environment: values arrive as parameters.

``retained/``, ``updater/`` and ``protection/`` are a library: what a ``LETO_*`` variable says
reaches them from ``runtime/``, the integrations or the top level, which read it
(``leto_lightning/env.py``: ``ProcessSettings.from_env()``, ``job_prefix()``). Read from the
source with ``ast``; a finding names file:line.

What counts as a read: ``os.environ`` / ``os.environb`` / ``os.getenv`` (however imported:
``from os import environ`` too), and a call of one of env.py's readers (a function of env.py
taking ``environ``, or any ``.from_env(...)``), which would read it one call away.

The exceptions, each with its reason, are in ``ALLOWED``; an entry that no longer matches a
read fails too, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

import leto_lightning.env as env_module

_SPEC = importlib.util.find_spec("leto_lightning")
assert _SPEC is not None and _SPEC.submodule_search_locations
SRC = Path(next(iter(_SPEC.submodule_search_locations)))
BELOW_RUNTIME = ("retained", "updater", "protection")

ENVIRON_ATTRIBUTES = {"environ", "environb", "getenv", "getenvb"}
READERS = {name for name, obj in vars(env_module).items()
           if inspect.isfunction(obj) and obj.__module__ == env_module.__name__
           and "environ" in inspect.signature(obj).parameters}

# (path under the package, enclosing function) -> why it may read the environment
ALLOWED = {
    ("protection/engines/isal.py", "_candidates"):
        "LETO_ISAL_LIBRARY (env.isal_library): ISA-L is loaded once per process when "
        "protection/checksum.py is imported, before any caller could pass a path",
    ("retained/backends/cuda_device.py", "require_cuda"):
        "CUDA_VISIBLE_DEVICES, torch's own variable, quoted in the error that says why no device is visible",
    ("retained/backends/cuda_server.py", "start"):
        "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, torch's own variables, in the state manager's own "
        "process: it turns expandable segments off when they would be on",
}


class _Reads(ast.NodeVisitor):
    """Every environment read of one module: (line, enclosing function, what)."""

    def __init__(self, readers: set[str]) -> None:
        self.readers = readers
        self.found: list[tuple[int, str, str]] = []
        self._functions: list[str] = []

    def _add(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), self._functions[-1] if self._functions else "<module>", what))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in ENVIRON_ATTRIBUTES:
            self._add(node, f"{ast.unparse(node)}")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ENVIRON_ATTRIBUTES:
            self._add(node, node.id)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "os" and not node.level:
            for alias in node.names:
                if alias.name in ENVIRON_ATTRIBUTES:
                    self._add(node, f"from os import {alias.name}")
        elif (node.module or "").split(".")[-1] == "env":
            for alias in node.names:
                if alias.name in self.readers:
                    self._add(node, f"imports the reader env.{alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "from_env" or name in self.readers:
            self._add(node, f"calls {ast.unparse(func)}()")
        self.generic_visit(node)


def reads_in(source: str, readers: set[str] = READERS) -> list[tuple[int, str, str]]:
    collector = _Reads(readers)
    collector.visit(ast.parse(source))
    return collector.found


def environment_reads() -> tuple[list[str], set[tuple[str, str]]]:
    """The findings (``path:line: what``) not in ``ALLOWED``, and the ``ALLOWED`` keys seen."""
    findings: list[str] = []
    allowed_seen: set[tuple[str, str]] = set()
    for layer in BELOW_RUNTIME:
        for path in sorted((SRC / layer).rglob("*.py")):
            rel = path.relative_to(SRC).as_posix()
            for line, function, what in reads_in(path.read_text()):
                if (rel, function) in ALLOWED:
                    allowed_seen.add((rel, function))
                    continue
                findings.append(f"src/leto_lightning/{rel}:{line}: {what} (in {function})")
    return findings, allowed_seen


def test_nothing_below_runtime_reads_the_environment() -> None:
    findings, _ = environment_reads()
    assert not findings, (f"{len(findings)} environment reads below runtime/ (read it in runtime/ or the "
                          "integrations and pass the value down, e.g. env.ProcessSettings):\n" + "\n".join(findings))


def test_every_exception_is_still_needed() -> None:
    _, seen = environment_reads()
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries that match no read any more (remove them): {stale}"


def test_the_check_catches_what_it_claims() -> None:
    """The detector itself, on made-up code (a check that passes on anything is a defect)."""
    code = (
        "import os\n"
        "from os import environ, getenv\n"
        "from ..env import job_prefix, FUSED_ADAM\n"
        "a = os.environ.get('X')\n"
        "b = os.getenv('X')\n"
        "def f():\n"
        "    return environ['X'], ProcessSettings.from_env(), job_prefix()\n"
    )
    found = reads_in(code, {"job_prefix"})
    whats = [what for _, _, what in found]
    assert "from os import environ" in whats and "from os import getenv" in whats
    assert "imports the reader env.job_prefix" in whats and not any("FUSED_ADAM" in w for w in whats)
    assert "os.environ" in whats and "os.getenv" in whats
    assert (7, "f", "environ") in found and (7, "f", "calls ProcessSettings.from_env()") in found
    assert (7, "f", "calls job_prefix()") in found
    assert reads_in("import os\nx = os.path.join('a', 'b')\nsettings = s.cuda_manager\n") == []
    assert {"job_prefix", "fused_adam_enabled", "isal_library", "cuda_manager", "run_dir"} <= READERS


if __name__ == "__main__":
    found, seen = environment_reads()
    stale = sorted(set(ALLOWED) - seen)
    print("\n".join(found + [f"stale ALLOWED entry: {s}" for s in stale]) or "no environment reads below runtime/")
    sys.exit(1 if found or stale else 0)
