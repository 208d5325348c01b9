"""The package's layers point one way, and no modules import each other in a cycle.

Read from the source with ``ast`` (nothing of the package is imported, except in the last
test, which starts a fresh interpreter without torch). Rules (docs/design.md section 3)::

    top level   cli, train, accelerate.py, demos/, examples/, testing/, the package __init__
        |       (may import anything; only testing/, demos/ and cli.py import testing/ or demos/)
    integrations/  ->  runtime/  ->  updater/  ->  retained/  ->  protection/   (only downward)

    leaves      errors.py, env.py (the LETO_* environment), recipes.py (the recipe schema), faults/ (named
                points and the injectors built on them), console.py, extras.py: importable from
                every layer; they import only other leaves
    models/     only models/ and the leaves
    sim/        only sim/, recipes.py and errors.py (it imports no torch)

Every import counts for the layers: at module level and inside functions (a lazy import is
still a dependency), under ``if TYPE_CHECKING:`` too. For cycles the module-level imports
count (those under ``if TYPE_CHECKING:`` too: two modules that need each other's types are
one design, whatever runs first), plus each package ``__init__`` that an import executes on
the way (``from a.b.c import x`` runs ``a/b/__init__.py``) -- except the importer's own
packages and the root package, which are already being imported -- and a package's
``TYPE_CHECKING`` imports of its own submodules (a lazy ``__init__`` naming what it re-exports).

``python tests/test_layering.py`` prints every finding without pytest.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = "leto_lightning"
_SPEC = importlib.util.find_spec(ROOT)  # finds the package without executing it
assert _SPEC is not None and _SPEC.submodule_search_locations
SRC = Path(next(iter(_SPEC.submodule_search_locations)))

CORE = ("protection", "retained", "updater", "runtime", "integrations")  # bottom to top
LEAVES = {f"{ROOT}.errors", f"{ROOT}.env", f"{ROOT}.recipes", f"{ROOT}.console", f"{ROOT}.extras"}
LEAF_PACKAGES = ("faults",)
TOP_FILES = {"__init__", "cli", "train", "accelerate", "demo", "demo_e2e"}
TOP_PACKAGES = ("examples", "testing", "demos")
HARNESSES = ("testing", "demos")  # only these and cli.py may import them
SIM_MAY_IMPORT = {f"{ROOT}.recipes", f"{ROOT}.errors"}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    module_level: bool  # not inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``
    implicit: bool  # a package __init__ that the import executes on the way to ``target``


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = [ROOT, *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    """Every import of a module with its line, and whether it runs when the module is imported."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, int, bool, bool]] = []
        self._in_function = 0
        self._type_only = 0

    def _base(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.module.split(".")
        if not self.is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno, *self._context()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node)
        submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        # ``from . import sibling`` needs nothing of the (partly initialised) own package: only
        # the sibling; a name defined in a package's __init__ does need that __init__
        if len(submodules) < len(node.names) or not self.module.startswith(base + "."):
            self.found.append((base, node.lineno, *self._context()))
        self.found.extend((name, node.lineno, *self._context()) for name in submodules)

    def _context(self) -> tuple[bool, bool]:
        return not self._in_function, bool(self._type_only)

    def _function(self, node: ast.AST) -> None:
        self._in_function += 1
        self.generic_visit(node)
        self._in_function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._type_only += 1
        for child in node.body:
            self.visit(child)
        self._type_only -= 1
        for child in node.orelse:
            self.visit(child)


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # without the root package


@functools.cache
def collect_imports() -> tuple[Import, ...]:
    out = []
    for module, path in MODULES.items():
        collector = _Collector(module, path.name == "__init__.py")
        collector.visit(ast.parse(path.read_text(), str(path)))
        mine = set(_ancestors(module)) | {module}
        for name, line, module_level, type_only in collector.found:
            target = _resolve(name) if name.split(".")[0] == ROOT else None
            if target is None or target == module:
                continue
            out.append(Import(module, target, line, module_level, type_only, implicit=False))
            out.extend(Import(module, pkg, line, module_level, type_only, implicit=True)
                       for pkg in _ancestors(target) if pkg not in mine)
    return tuple(out)


# -- layers ------------------------------------------------------------------------------------
def kind(module: str) -> str:
    """``leaf``, ``top``, ``harness``, ``models``, ``sim``, ``core:<i>`` or ``unplaced``."""
    parts = module.split(".")
    if module in LEAVES or (len(parts) > 1 and parts[1] in LEAF_PACKAGES):
        return "leaf"
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in TOP_FILES and not (SRC / parts[1]).is_dir()):
        return "top"
    if parts[1] in HARNESSES:
        return "harness"
    if parts[1] in TOP_PACKAGES:
        return "top"
    if parts[1] in ("models", "sim"):
        return parts[1]
    if parts[1] in CORE:
        return f"core:{CORE.index(parts[1])}"
    return "unplaced"


def wrong_way(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering, or None."""
    src, dst = kind(imp.importer), kind(imp.target)
    if dst == "harness" and src != "harness" and imp.importer != f"{ROOT}.cli":
        return "only testing/, demos/ and cli.py import the test harnesses and demos"
    if src in ("top", "harness"):
        return None
    if src == "sim":
        return None if dst == "sim" or imp.target in SIM_MAY_IMPORT else "sim imports only sim/, recipes and errors"
    if dst == "leaf":
        return None
    if src == "leaf":
        return "a leaf imports only other leaves (errors, env, recipes, faults, console, extras)"
    if src == "models":
        return None if dst == "models" else "models imports only models/ and the leaves"
    if src.startswith("core:") and dst.startswith("core:"):
        if int(dst[5:]) <= int(src[5:]):
            return None
        below = ", ".join(CORE[: int(src[5:]) + 1])
        return f"{CORE[int(src[5:])]} may import only {below} (imports point down)"
    return f"the core ({'/'.join(CORE)}) imports no {dst} module"


def layering_violations(imports: tuple[Import, ...]) -> list[str]:
    found = []
    for module in sorted(MODULES):
        if kind(module) == "unplaced":
            found.append(f"{MODULES[module].relative_to(SRC.parent)}: {module} is in no layer: place its package in "
                         "tests/test_layering.py (or delete it)")
    for imp in sorted(imports, key=lambda i: (i.importer, i.line, i.target)):
        why = None if imp.implicit else wrong_way(imp)
        if why:
            where = " (inside a function)" if not imp.module_level else " (TYPE_CHECKING)" if imp.type_only else ""
            found.append(f"{MODULES[imp.importer].relative_to(SRC.parent)}:{imp.line}: {imp.importer} -> "
                         f"{imp.target}{where}: {why}")
    return found


def lazy_package_violations(imports: tuple[Import, ...]) -> list[str]:
    """The ``__init__`` of a package holding a leaf runs whenever the leaf is imported: it may
    import only leaves at import time (a lazy ``__getattr__`` for anything else)."""
    found = []
    packages = {pkg for leaf in MODULES if kind(leaf) == "leaf" for pkg in _ancestors(leaf)}
    for imp in imports:
        if imp.importer in packages and kind(imp.importer) != "leaf" and imp.module_level and not imp.type_only \
                and kind(imp.target) != "leaf" and imp.target not in packages:
            found.append(f"{MODULES[imp.importer].relative_to(SRC.parent)}:{imp.line}: {imp.importer} -> "
                         f"{imp.target}: this package holds a leaf; import it on first use (PEP 562 __getattr__)")
    return found


# -- cycles ------------------------------------------------------------------------------------
def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def cycles(imports: tuple[Import, ...]) -> list[str]:
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], Import] = {}
    for imp in imports:
        reexport = imp.type_only and imp.target.startswith(imp.importer + ".")  # a lazy __init__'s names, typed
        if imp.module_level and not reexport:
            graph[imp.importer].add(imp.target)
            where.setdefault((imp.importer, imp.target), imp)
    found = []
    for component in strongly_connected(graph):
        members = set(component)
        edges = [where[(a, b)] for a in component for b in sorted(graph[a] & members)]
        lines = [f"    {MODULES[e.importer].relative_to(SRC.parent)}:{e.line}: {e.importer} -> {e.target}"
                 + (" (its package __init__ runs)" if e.implicit else " (TYPE_CHECKING)" if e.type_only else "")
                 for e in edges]
        found.append(f"import cycle among {len(component)} modules: {', '.join(component)}\n" + "\n".join(lines))
    return found


# -- tests -------------------------------------------------------------------------------------
def test_every_package_is_covered() -> None:
    packages = {m.split(".")[1] for m in MODULES if "." in m}
    assert {*CORE, "models", "sim", "faults", "errors", "cli"} <= packages, sorted(packages)
    assert len(MODULES) > 50


def test_imports_point_down() -> None:
    found = layering_violations(collect_imports())
    assert not found, f"{len(found)} wrong-way imports:\n" + "\n".join(found)


def test_packages_holding_a_leaf_import_lazily() -> None:
    found = lazy_package_violations(collect_imports())
    assert not found, "\n".join(found)


def test_no_import_cycles() -> None:
    found = cycles(collect_imports())
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(found)


def test_the_rules_catch_what_they_claim() -> None:
    """The rules themselves, on made-up edges (a layering test that passes on anything is a defect)."""
    def why(a: str, b: str) -> str | None:
        return wrong_way(Import(f"{ROOT}.{a}", f"{ROOT}.{b}", 1, True, False, False))

    assert why("protection.codec", "retained.store") and why("retained.store", "updater.transaction")
    assert why("runtime.agent", "integrations.lightning.strategy") and why("updater.recovery", "runtime.agent")
    assert why("integrations.lightning.strategy", "protection.codec") is None
    assert why("retained.shm", "env") is None and why("protection.codec", "errors") is None
    assert why("env", "runtime.session") and why("recipes", "models.moe_transformer")
    assert why("sim.workload", "recipes") is None and why("sim.workload", "env")
    assert why("sim.report", "models.moe_transformer") and why("models.data", "runtime.session")
    assert why("runtime.agent", "testing.crash") and why("cli", "testing.crash") is None
    assert why("examples.recipe_train", "demos.core") and why("testing.crash", "runtime.agent") is None
    assert why("runtime.agent", "models.moe_transformer") and why("runtime.agent", "cli")
    assert kind(f"{ROOT}.metrics") == "unplaced" and kind(f"{ROOT}.faults.points") == "leaf"
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_sim_and_the_leaves_load_without_torch() -> None:
    """What the layering promises, run: the simulator and every leaf import in a fresh
    interpreter without loading torch (or Lightning)."""
    names = sorted(m for m in MODULES if kind(m) in ("sim", "leaf"))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "heavy = sorted(m for m in ('torch', 'lightning') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    everything = collect_imports()
    report = [*layering_violations(everything), *lazy_package_violations(everything), *cycles(everything)]
    print("\n".join(report) or "layering and cycles: clean")
    sys.exit(1 if report else 0)
