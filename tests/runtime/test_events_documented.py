"""``docs/events.md`` is the contract of ``events.jsonl``: every event class of
``runtime/event_types.py`` is documented with every field it is written with, nothing documented
lacks a class, every class is written somewhere in the package, and no code writes an event other
than through an event class (no event named by a string literal, no hand-built record). Read from
the classes and the source, not from a run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import leto_lightning
from leto_lightning.runtime import event_types
from leto_lightning.runtime.event_types import EVENT_TYPES, Event, UnknownEvent, payload_fields

PACKAGE = Path(leto_lightning.__file__).parent
DOC = PACKAGE.parent.parent / "docs" / "events.md"
COMMON = {"time", "event", "generation"}
SERIALISER = Path(event_types.__file__)  # ``to_record``: the one place a record is built


def _documented() -> dict[str, str]:
    """{event name: its row's fields column} from the events table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| (.*)\|\s*$", line)
        if m and m.group(1) not in COMMON:
            rows[m.group(1)] = m.group(2)
    return rows


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def _constructed() -> set[str]:
    """The names of the event classes some module of the package builds (``JobStarted(...)``,
    also under an alias of its import)."""
    names = {cls.__name__: name for name, cls in EVENT_TYPES.items()}
    built: set[str] = set()
    for _, tree in _modules():
        local = dict(names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("event_types"):
                local.update({a.asname: names[a.name] for a in node.names if a.asname and a.name in names})
        built |= {local[n.func.id] for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in local}
    return built


def test_every_event_class_is_registered() -> None:
    classes = [c for c in vars(event_types).values()
               if isinstance(c, type) and issubclass(c, Event) and c not in (Event, UnknownEvent)]
    assert sorted(c.__name__ for c in classes) == sorted(c.__name__ for c in EVENT_TYPES.values())
    assert all(name == cls.NAME and name for name, cls in EVENT_TYPES.items())


def test_every_event_class_is_documented_and_every_documented_event_has_one() -> None:
    documented = _documented()
    assert documented, "no event row found in docs/events.md: the table parse is broken"
    assert sorted(set(EVENT_TYPES) - set(documented)) == [], "an event class not in docs/events.md"
    assert sorted(set(documented) - set(EVENT_TYPES)) == [], "in docs/events.md but no event class"


def test_every_event_class_is_written_somewhere() -> None:
    assert sorted(set(EVENT_TYPES) - _constructed()) == [], "an event class the package never writes"


def test_every_field_is_named_in_its_row() -> None:
    documented = _documented()
    missing = {name: sorted(f.name for f in payload_fields(cls) if f"`{f.name}`" not in documented.get(name, ""))
               for name, cls in EVENT_TYPES.items()}
    assert {e: m for e, m in missing.items() if m} == {}


def test_no_event_is_written_but_through_an_event_class() -> None:
    """No ``emit("name", ...)``/``try_emit`` call and no dict with an ``"event"`` key (a record
    built by hand) outside the serialiser."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', 0)}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("emit", "try_emit") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.append(f"{where} {node.func.attr}({node.args[0].value!r})")
            elif isinstance(node, ast.Dict) and path != SERIALISER:
                if "event" in [k.value for k in node.keys if isinstance(k, ast.Constant)]:
                    found.append(f"{where} a dict with an \"event\" key")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
                  and any(k.arg == "event" for k in node.keywords)):
                found.append(f"{where} dict(event=...)")
    assert found == []
