"""Recovery metrics for Lightning's loggers, read from the agent's ``events.jsonl``.

The agent writes one ``recovery_finished`` event per in-place recovery (docs/events.md) once
every rank completed its first step after resuming. ``LetoStrategy`` (global rank 0) reads the
new events at the start of training batches and logs, per recovery, at the current step:

==================================  ===========================================================
``leto/recovery/<part>_s``          the breakdown: detect, stop, attach_repair, transfer (a
                                    lost node's state to its spare), init, resume, recompute (s)
``leto/recovery/total_s``           failure -> first completed step after it
``leto/recovery/first_iteration_s`` resumed -> first completed step
``leto/recovery/generation``        the generation the recovery opened
``leto/recovery/shadow_level``      the shadow level the job recovered from: 3, 2, 1 (a promoted
                                    shadow at L3/L2/L1), 0 (no ready shadow: a cold start)
``leto/recovery/failed_iteration``  the step the failure interrupted (last heartbeat)
``leto/recovery/resume_iteration``  the first retained iteration (optimizer update) after it
``leto/recovery/resume_step``       the same point as Lightning's global step (more than the
                                    iteration when 16-mixed's scaler skipped updates)
``leto/recovery/kept_iterations``   steps a restart from the newest checkpoint file would have
                                    redone (resume_step - that file's global step)
``leto/recoveries``                 recoveries finished so far
``leto/hof_count``                  failures classified as HOF so far
``leto/recovered_iterations``       sum of ``kept_iterations`` so far
``leto/ettr``                       running effective training time ratio:
                                    1 - sum(total_s) / (event time - job start)
==================================  ===========================================================

Which recoveries a run has logged is part of the resume payload, so a trainer that resumes
re-logs exactly the ones its predecessor logged after its last recorded payload.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...runtime.event_types import (
    Classification,
    Event,
    FallbackCheckpoint,
    JobStarted,
    RecoveryFailed,
    RecoveryFinished,
    RecoveryStarted,
    from_record,
)
from ...runtime.events import EVENTS_FILE

BREAKDOWN = ("detect", "stop", "attach_repair", "transfer", "init", "resume", "recompute")


@dataclass
class EventReader:
    """Reads ``events.jsonl`` incrementally (complete lines only), as event objects."""

    run_dir: str
    events: list[Event] = field(default_factory=list)
    _offset: int = 0

    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, EVENTS_FILE)

    def poll(self) -> list[Event]:
        """The events appended since the last call."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if size <= self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        new = [from_record(json.loads(line)) for line in data[:end].splitlines() if line.strip()]
        self._offset += end
        self.events.extend(new)
        return new


def finished_recoveries(events: Iterable[Event]) -> list[RecoveryFinished]:
    """``recovery_finished`` events of recoveries that reached their first step."""
    return [e for e in events if isinstance(e, RecoveryFinished) and not e.interrupted]


def job_start(events: Iterable[Event]) -> float | None:
    return next((e.time for e in events if isinstance(e, JobStarted)), None)


def hof_count(events: Iterable[Event], hof: bool = True) -> int:
    """Failures classified as HOF (``hof=False``: as not a HOF)."""
    return sum(1 for e in events if isinstance(e, Classification) and bool(e.hof) == hof)


def metrics_for(event: RecoveryFinished, events: list[Event], kept_iterations: int,
                recovered_before: int) -> dict[str, float]:
    """The logged metrics of one ``recovery_finished`` event (module doc)."""
    upto = [e for e in events if e.time <= event.time]
    done = finished_recoveries(upto)
    breakdown = event.breakdown or {}
    out: dict[str, float] = {f"leto/recovery/{k}_s": float(breakdown.get(k, 0.0)) for k in BREAKDOWN}
    out.update({
        "leto/recovery/total_s": float(event.total_s or 0.0),
        "leto/recovery/first_iteration_s": float(event.first_iteration_s or 0.0),
        "leto/recovery/generation": float(event.generation),
        "leto/recovery/shadow_level": float(event.shadow_level or 0),
        "leto/recovery/failed_iteration": float(event.failed_iteration if event.failed_iteration is not None
                                                else -1),
        "leto/recovery/resume_iteration": float(event.resume_iteration if event.resume_iteration is not None
                                                else -1),
        "leto/recovery/kept_iterations": float(kept_iterations),
        "leto/recoveries": float(len(done)),
        "leto/hof_count": float(hof_count(upto)),
        "leto/recovered_iterations": float(recovered_before + kept_iterations),
    })
    start = job_start(upto)
    if start is not None and event.time > start:
        lost = sum(float(e.total_s or 0.0) for e in done)
        out["leto/ettr"] = max(0.0, 1.0 - lost / (event.time - start))
    return out


def recoveries_open(events: Iterable[Event]) -> bool:
    """A recovery started whose books are not closed yet (finished, failed or a checkpoint restart)."""
    started = sum(1 for e in events if isinstance(e, RecoveryStarted))
    closed = sum(1 for e in events if isinstance(e, (RecoveryFinished, RecoveryFailed, FallbackCheckpoint)))
    return closed < started


def summary_rows(events: list[Event]) -> list[dict[str, Any]]:
    rows = []
    for e in events:
        if not isinstance(e, RecoveryFinished):
            continue
        b = e.breakdown or {}
        rows.append({"gen": e.generation, "failed it": e.failed_iteration, "resumed it": e.resume_iteration,
                     "via": e.promoted, "level": e.shadow_level, **{k: b.get(k) for k in BREAKDOWN},
                     "total": e.total_s, "status": "interrupted" if e.interrupted else "ok"})
    return rows


def summary_table(events: list[Event], now: float | None = None) -> str:
    """A plain-text table of every recovery of the job so far, with totals and ETTR."""
    rows = summary_rows(events)
    hofs, non_hof = hof_count(events), hof_count(events, hof=False)
    fallbacks = sum(1 for e in events if isinstance(e, FallbackCheckpoint))
    lines = ["Leto recoveries (seconds)"]
    if rows:
        cols = list(rows[0])
        cells = [[_fmt(r[c]) for c in cols] for r in rows]
        widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    else:
        lines.append("  (none)")
    done = finished_recoveries(events)
    lost = sum(float(e.total_s or 0.0) for e in done)
    start = job_start(events)
    tail = f"HOFs: {hofs}  non-HOF failures: {non_hof}  checkpoint restarts: {fallbacks}  " \
           f"in-place recoveries: {len(done)}  time lost: {lost:.2f} s"
    if start is not None and now is not None and now > start:
        tail += f"  ETTR: {max(0.0, 1 - lost / (now - start)):.4f} over {now - start:.1f} s"
    lines.append(tail)
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
