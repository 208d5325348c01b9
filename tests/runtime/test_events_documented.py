"""``docs/events.md`` is the contract of ``events.jsonl``: every event the package writes is
documented, nothing documented is gone, and every field an event is written with is named in its
row. Read from the source (every ``emit``/``try_emit`` call with a literal event name, and the
one record a trainer writes by hand), not from a run."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import leto_lightning

PACKAGE = Path(leto_lightning.__file__).parent
DOC = PACKAGE.parent.parent / "docs" / "events.md"
COMMON = {"time", "event", "generation"}


def _written() -> dict[str, set[str]]:
    """{event name: the field names some call site writes it with}."""
    fields: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("emit", "try_emit") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                fields[node.args[0].value] |= {k.arg for k in node.keywords if k.arg is not None}
            elif isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                if "event" in keys:
                    value = node.values[keys.index("event")]
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        fields[value.value] |= {k for k in keys if isinstance(k, str)} - COMMON
    return fields


def _documented() -> dict[str, str]:
    """{event name: its row's fields column} from the events table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| (.*)\|\s*$", line)
        if m and m.group(1) not in COMMON:
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_event_written_is_documented_and_every_documented_one_written() -> None:
    written, documented = _written(), _documented()
    assert written, "no emit call found: the scan is broken"
    assert sorted(set(written) - set(documented)) == [], "written but not in docs/events.md"
    assert sorted(set(documented) - set(written)) == [], "in docs/events.md but never written"


def test_every_field_written_is_named_in_its_row() -> None:
    documented = _documented()
    missing = {event: sorted(f for f in names if f"`{f}`" not in documented.get(event, ""))
               for event, names in _written().items()}
    assert {e: m for e, m in missing.items() if m} == {}
