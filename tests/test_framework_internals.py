"""Private Lightning, Accelerate and torch internals are used in a few modules only, and each one
used still exists on the installed versions.

The internals modules (``INTERNALS``) hold every access to a private attribute of a framework
object or module, and every patch of a framework class, as small named functions; each lists
what it uses in its inventory (``PRIVATE_ATTRIBUTES``: the owner's import path -> the names).
Two kinds of check:

- the inventories: every listed name exists on the installed frameworks (an attribute of the
  module or class, or for an instance attribute a word of the class's source), so an upgrade
  that removes one fails here, naming it;
- the rest of the package (read with ``ast``): no private attribute access ``x._name`` (single
  leading underscore) unless ``x`` is ``self``/``cls``/``super()`` or ``_name`` is Leto's own
  (a ``def _name``, ``self._name =``, a class or module-level private name anywhere in the
  package, or a ``_leto_`` name Leto puts on framework objects) and not an inventory name; the
  same for ``getattr``/``hasattr``/``setattr``/``delattr`` with a constant name and for string
  constants equal to an inventory name; no import of a private framework name or module; no
  assignment to an attribute of a framework module or class (a monkey patch) and no
  ``__class__`` swap. A Leto class that subclasses a framework class may override a private
  framework method only when an inventory lists it, and reads or writes none of the framework's
  private attributes through ``self`` (that check imports the modules to see the MRO).

``python tests/test_framework_internals.py`` prints every finding and the count without pytest.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from test_layering import MODULES, ROOT, SRC  # the package's modules, found as the layering test finds them

INVENTORY_MODULES = (
    f"{ROOT}.integrations.lightning.internals",
    f"{ROOT}.integrations.accelerate.internals",
    f"{ROOT}.retained.torch_internals",
)
FSDP2_BINDING = f"{ROOT}.updater.fsdp2"  # keeps its own inventory (owner class name, attribute)
INTERNALS = (*INVENTORY_MODULES, FSDP2_BINDING)
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "torch", "tensorboard")
OPTIONAL = ("tensorboard",)  # inventory owners in packages a user may not have installed
# private names of the standard library used outside the internals modules, and why
STDLIB_ALLOWED = {
    ("os", "_exit"): "documented: leave a forked child without running the parent's cleanup",
    ("argparse", "_SubParsersAction"): "the type add_subparsers() returns (annotations only)",
}
FSDP2_OWNERS = {
    "FSDPModule": "torch.distributed.fsdp.FSDPModule",
    "FSDPState": "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState",
    "FSDPParamGroup": "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup",
    "FSDPParam": "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam",
    "DTensor": "torch.distributed.tensor.DTensor",
}
_ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.what}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_framework(module: str) -> bool:
    return module.split(".")[0] in FRAMEWORKS


@functools.cache
def _tree(module: str) -> ast.Module:
    path = MODULES[module]
    return ast.parse(path.read_text(), str(path))


def _inventory_source(module: str) -> dict[str, tuple[str, ...]]:
    """An internals module's ``PRIVATE_ATTRIBUTES``, read without importing it."""
    for node in _tree(module).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "PRIVATE_ATTRIBUTES" and node.value is not None:
            value = ast.literal_eval(node.value)
            if isinstance(value, tuple):  # the FSDP2 binding's ((owner, name), ...)
                grouped: dict[str, tuple[str, ...]] = {}
                for owner, name in value:
                    grouped[owner] = (*grouped.get(owner, ()), name)
                return grouped
            return dict(value)
    raise AssertionError(f"{module} has no PRIVATE_ATTRIBUTES")


@functools.cache
def inventory_names() -> frozenset[str]:
    """Every private name any inventory lists."""
    return frozenset(n for m in INTERNALS for names in _inventory_source(m).values() for n in names)


@functools.cache
def leto_owned() -> frozenset[str]:
    """Private names Leto defines itself, less the inventories' (a Leto name that is also a
    framework's proves nothing about the object it is read from)."""
    names: set[str] = set()
    for module in MODULES:
        for node in ast.walk(_tree(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return frozenset(n for n in names if _private(n)) - inventory_names()


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _framework_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> framework module it was imported from (``import torch``, ``from
    accelerate.state import PartialState``, anywhere in the module)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_framework(alias.name):
                    names[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _is_framework(node.module):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


class _Scan(ast.NodeVisitor):
    """The static findings of one module (see the module doc)."""

    def __init__(self, module: str) -> None:
        self.path = str(MODULES[module].relative_to(SRC.parent))
        self.framework = _framework_names(_tree(module))
        self.findings: list[Finding] = []

    def add(self, node: ast.AST, kind: str, what: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), kind, what))

    def _refused(self, owner: ast.expr, name: str) -> bool:
        if not _private(name) or name.startswith("_leto_") or _is_self(owner):
            return False
        if isinstance(owner, ast.Name) and (owner.id, name) in STDLIB_ALLOWED:
            return False
        return name not in leto_owned()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._refused(node.value, node.attr):
            self.add(node, "private attribute", ast.unparse(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in _ACCESSORS and len(node.args) >= 2:
            owner, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if self._refused(owner, name.value):
                    self.add(node, "private attribute", ast.unparse(node))
                if func.id in ("setattr", "delattr") and (
                        name.value == "__class__" or self._framework_root(owner)):
                    self.add(node, "monkey patch", ast.unparse(node))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in inventory_names():
            self.add(node, "private name", repr(node.value))

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        if isinstance(key, ast.Constant) and key.value == "__class__" and ast.unparse(node.value).endswith("__dict__"):
            self.add(node, "monkey patch", ast.unparse(node))  # object.__dict__["__class__"].__set__
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level and _is_framework(node.module):
            if any(_private(part) for part in node.module.split(".")):
                self.add(node, "private import", node.module)
            for alias in node.names:
                if _private(alias.name):
                    self.add(node, "private import", f"{node.module}.{alias.name}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_framework(alias.name) and any(_private(p) for p in alias.name.split(".")):
                self.add(node, "private import", alias.name)

    def _framework_root(self, target: ast.expr) -> bool:
        root = _root(target)
        return root is not None and root in self.framework

    def _check_targets(self, targets: list[ast.expr]) -> None:
        for target in targets:
            for node in ast.walk(target):
                stored = isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))
                if not stored or not isinstance(node, (ast.Attribute, ast.Subscript)):
                    continue
                if isinstance(node, ast.Attribute) and node.attr == "__class__":
                    self.add(node, "monkey patch", f"{ast.unparse(node)} (a class swap)")
                elif self._framework_root(node.value):
                    self.add(node, "monkey patch", f"{ast.unparse(node)} (state of a framework module or class)")

    def visit_Assign(self, node: ast.Assign) -> None:
        self._check_targets(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_targets([node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_targets([node.target])
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._check_targets(node.targets)
        self.generic_visit(node)


def _checked_modules() -> Iterator[str]:
    return (m for m in MODULES if m not in INTERNALS)


def static_findings() -> list[Finding]:
    """Private framework accesses and monkey patches outside the internals modules (``ast``)."""
    findings = []
    for module in _checked_modules():
        scan = _Scan(module)
        scan.visit(_tree(module))
        findings += scan.findings
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.what))


# -- Leto classes that subclass framework classes (imports the modules) ---------------------------
def _framework_private(cls: type) -> set[str]:
    """Private names the framework classes in ``cls``'s MRO define or set on ``self``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not _is_framework(klass.__module__):
            continue
        names.update(n for n in vars(klass) if _private(n))
        try:
            names.update(re.findall(r"self\.(_\w+)", inspect.getsource(klass)))
        except (OSError, TypeError):  # a class without Python source (torch's C classes)
            pass
    return {n for n in names if _private(n)}


def _classes_with_bases(module: str) -> list[ast.ClassDef]:
    return [n for n in _tree(module).body if isinstance(n, ast.ClassDef) and n.bases]


def subclass_findings() -> list[Finding]:
    """In Leto classes deriving from framework classes: framework-private attributes read or
    written through ``self``, and overrides of private framework methods no inventory lists."""
    findings = []
    for module in _checked_modules():
        classes = _classes_with_bases(module)
        if not classes:
            continue
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # an optional dependency (not this package) is missing
            if (exc.name or "").startswith(ROOT):
                raise
            continue
        path = str(MODULES[module].relative_to(SRC.parent))
        for node in classes:
            cls = getattr(loaded, node.name, None)
            if not isinstance(cls, type):
                continue
            private = _framework_private(cls)
            for child in ast.walk(node):
                if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and \
                        child.value.id in ("self", "cls") and child.attr in private:
                    findings.append(Finding(path, child.lineno, "private attribute",
                                            f"{ast.unparse(child)} (inherited from a framework class)"))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name in private \
                        and child.name not in inventory_names():
                    findings.append(Finding(path, child.lineno, "private override",
                                            f"{node.name}.{child.name} (list it in an inventory)"))
    return sorted(set(findings), key=lambda f: (f.path, f.line, f.what))


# -- the inventories -------------------------------------------------------------------------------
def _resolve(path: str) -> Any:
    """The module or class at a dotted import path (the longest importable module prefix, then
    attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def _source(obj: Any) -> str:
    owners = [k for k in obj.__mro__ if _is_framework(k.__module__)] if isinstance(obj, type) else [obj]
    text = []
    for owner in owners:
        try:
            text.append(inspect.getsource(owner))
        except (OSError, TypeError):
            pass
    return "\n".join(text)


def missing_names(inventory: dict[str, tuple[str, ...]]) -> list[str]:
    """Inventory entries absent from the installed frameworks (optional packages skipped)."""
    missing = []
    for owner_path, names in inventory.items():
        try:
            owner = _resolve(owner_path)
        except ModuleNotFoundError:
            if owner_path.split(".")[0] in OPTIONAL:
                continue
            missing.append(f"{owner_path} (cannot import)")
            continue
        except AttributeError:
            missing.append(f"{owner_path} (no such attribute)")
            continue
        source = None
        for name in names:
            if hasattr(owner, name):
                continue
            source = _source(owner) if source is None else source
            if not re.search(rf"\b{re.escape(name)}\b", source):
                missing.append(f"{owner_path}.{name}")
    return missing


def _inventory(module: str) -> dict[str, tuple[str, ...]]:
    loaded = importlib.import_module(module)
    if module == FSDP2_BINDING:
        return {FSDP2_OWNERS[owner]: names for owner, names in _inventory_source(module).items()}
    inventory: dict[str, tuple[str, ...]] = loaded.PRIVATE_ATTRIBUTES
    return inventory


# -- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", INTERNALS)
def test_every_inventoried_private_name_exists_on_the_installed_frameworks(module: str) -> None:
    assert not missing_names(_inventory(module)), f"{module}: moved or removed upstream -- adapt it"


@pytest.mark.parametrize("module", INVENTORY_MODULES[:2])
def test_every_patched_framework_attribute_exists(module: str) -> None:
    patches = importlib.import_module(module).PATCHES
    assert patches and all(why for why in patches.values())
    for target in patches:
        owner, _, attr = target.rpartition(".")
        assert hasattr(_resolve(owner), attr), target


def test_the_inventory_check_fails_for_a_name_that_is_gone() -> None:
    assert missing_names({"torch.optim.Optimizer": ("_no_such_attribute_leto",)}) == [
        "torch.optim.Optimizer._no_such_attribute_leto"]
    assert missing_names({"torch.optim.Optimizer": ("zero_grad", "_opt_called")}) == [
        "torch.optim.Optimizer._opt_called"]
    assert missing_names({"torch.optim.lr_scheduler": ("_opt_called",)}) == []  # a word of the module's source


def test_no_private_framework_access_outside_the_internals_modules() -> None:
    findings = static_findings()
    print(f"private framework accesses outside the internals modules: {len(findings)}")
    assert not findings, "\n".join(map(str, findings))


def test_no_private_framework_attribute_through_self_in_subclasses() -> None:
    findings = subclass_findings()
    assert not findings, "\n".join(map(str, findings))


def test_the_scan_sees_what_it_refuses() -> None:
    """The rules catch each kind they name (a scan of a synthetic module)."""
    source = '''
import lightning.pytorch as pl
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
from accelerate.state import PartialState
def f(trainer, opt, loader, cls):
    trainer.fit_loop._restarting = False
    opt._opt_called = True
    getattr(trainer, "_logger_connector")
    pl.Trainer.__init__ = None
    PartialState._shared_state["x"] = 1
    loader.__class__ = cls
    object.__dict__["__class__"].__set__(loader, cls)
    key = "_growth_tracker"
    self._fine = opt._leto_fine
'''
    tree = ast.parse(source)
    scan = _Scan.__new__(_Scan)
    scan.path, scan.framework, scan.findings = "synthetic", _framework_names(tree), []
    scan.visit(tree)
    kinds = sorted((f.line, f.kind) for f in scan.findings)
    assert kinds == [(3, "private import"), (6, "private attribute"), (7, "private attribute"),
                     (8, "private attribute"), (8, "private name"), (9, "monkey patch"), (10, "monkey patch"),
                     (10, "private attribute"), (11, "monkey patch"), (12, "monkey patch"),
                     (13, "private name")], kinds


if __name__ == "__main__":
    found = static_findings() + subclass_findings()
    for finding in found:
        print(finding)
    print(f"private framework accesses outside the internals modules: {len(found)}")
    sys.exit(1 if found else 0)
