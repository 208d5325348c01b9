"""The run directory's event log: one JSON object per line, one line per lifecycle event.

Schema (docs/events.md): every event has ``time`` (Unix seconds), ``event`` and
``generation``; the other fields depend on the event. Readers must ignore unknown fields.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Append-only JSON-lines log, safe to call from several threads of the agent."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1)

    def emit(self, event: str, generation: int, **fields: Any) -> dict:
        record = {"time": time.time(), "event": event, "generation": generation, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    return list(iter_events(run_dir))


def iter_events(run_dir: str | os.PathLike) -> Iterator[dict]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)
