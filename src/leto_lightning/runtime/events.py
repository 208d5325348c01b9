"""The run directory's event log: one JSON object per line, one line per lifecycle event.

Schema (docs/events.md): every event has ``time`` (Unix seconds), ``event`` and
``generation``; the other fields depend on the event. Readers must ignore unknown fields.
Each event is a class of ``event_types.py``: ``EventLog.write`` takes one, ``iter_typed_events``
gives them back (``iter_events``: the records as written, dicts).

Each record is one ``os.write`` of a whole line to a file opened ``O_APPEND``; a write the
filesystem could not take whole (a full disk) is cut back off, so the log never ends in half a
record, and the writer raises ``StorageError``. Readers still skip a torn last line (a log
written by an older version, or a machine that lost power mid-write).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, LetoError
from .event_types import Event, from_record, to_record
from .storage import StorageError, open_run_dir_file

EVENTS_FILE = "events.jsonl"
log = logging.getLogger(__name__)


class EventLogError(LetoError):
    """An event log line that is not an event record (hand-edited or corrupted)."""


class EventLog:
    """Append-only JSON-lines log, safe to call from several threads of the agent."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # never through a link someone planted (PlantedLinkError), only a plain file of ours
            self._fd: int | None = open_run_dir_file(str(self.path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigurationError(
                f"run dir {str(run_dir)!r} cannot hold the event log ({exc.strerror}: {exc.filename}): "
                "choose a directory you can write (--run-dir)") from exc
        self._lock = threading.Lock()

    def write(self, event: Event) -> dict[str, Any]:
        """Append ``event`` (its record, stamped with the time of writing); the record written."""
        record = to_record(event, time.time())
        line = encode(record)
        with self._lock:
            if self._fd is None:
                raise StorageError(f"event log {self.path} is closed (a write failed before)")
            self._append(self._fd, line)
        return record

    def _append(self, fd: int, line: bytes) -> None:
        size = os.fstat(fd).st_size
        error: OSError | None = None
        try:
            written = os.write(fd, line)
        except OSError as exc:
            written, error = -1, exc
        if written == len(line):
            return
        try:  # a short write (full disk): cut it off, so the log ends at the last whole record
            os.ftruncate(fd, size)
        except OSError:
            pass
        reason = error.strerror if error is not None else f"only {written} of {len(line)} bytes written"
        raise StorageError(f"cannot write the event log {self.path}: {reason}; free space in the run dir and "
                           "relaunch (the log is intact up to its last whole record)") from error

    def try_write(self, event: Event) -> dict[str, Any] | None:
        """``write``, for the last words of a job: a full disk must not hide why the job ended."""
        try:
            return self.write(event)
        except StorageError as exc:
            log.warning("event %s not logged: %s", event.NAME, exc)
            return None

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def encode(record: dict[str, Any]) -> bytes:
    """One record's line (``to_record``'s dict), as the log holds it."""
    return (json.dumps(record, default=str) + "\n").encode()


def event_line(event: Event) -> bytes:
    """``event``'s line stamped now, for a writer without an ``EventLog`` (a trainer appending to
    the agent's log)."""
    return encode(to_record(event, time.time()))


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    return list(iter_events(run_dir))


def iter_events(run_dir: str | os.PathLike) -> Iterator[dict]:
    """The records of a run dir's log; a torn last line (no newline, not JSON) is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    try:
        fd = open_run_dir_file(str(path), os.O_RDONLY)  # a link planted in its place is refused, not read
    except FileNotFoundError:
        return
    with open(fd, errors="replace") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                log.warning("%s: skipping a torn last line (a write cut short)", path)
                return
            raise EventLogError(f"{path} line {number} is not JSON: fix or delete that line") from None
        if not isinstance(record, dict) or "event" not in record:
            raise EventLogError(f"{path} line {number} is not an event record (no \"event\" key): fix or delete "
                                "that line")
        yield record


def read_typed_events(run_dir: str | os.PathLike) -> list[Event]:
    return list(iter_typed_events(run_dir))


def iter_typed_events(run_dir: str | os.PathLike) -> Iterator[Event]:
    """``iter_events``, each record parsed into its event class (``event_types.from_record``)."""
    return (from_record(record) for record in iter_events(run_dir))
