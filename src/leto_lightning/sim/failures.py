"""Failure arrivals: Poisson from a job MTTF (or a per-GPU MTTF scaled by cluster size), a share
of hardware-operable failures (HOFs), or a trace file.

Default reference (``docs/design.md`` section 1): Llama 3 saw 419 unexpected interruptions in 54 days
on 16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4), i.e. a job
MTTF of 3.1 h and a per-GPU MTTF of 54 d x 16,384 / 419 = 50,700 GPU-hours (5.8 years). Scaled to
131,072 GPUs that is a 23-minute job MTTF; Kokolis et al. (HPCA 2025, "Revisiting Reliability in
Large-Scale Machine Learning Research Clusters") project about 14 minutes at that scale.

Trace format (CSV, one failure per line, ``#`` comments and a header line allowed)::

    time,kind
    812.5,hof
    4410,non-hof

``time`` is seconds since the job started; ``kind`` is ``hof`` or ``non-hof`` (also accepted:
``nonhof``, ``non_hof``, ``1``/``0``, ``true``/``false``).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from leto_lightning.sim.checks import fail, fraction, int_at_least, positive, require

LLAMA3_GPU_MTTF_S = 54 * 86400 / 419 * 16384   # Llama 3: 419 interruptions, 54 days, 16,384 GPUs

_UNITS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0,
          "d": 86400.0, "day": 86400.0, "days": 86400.0, "y": 365 * 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_KINDS = {"hof": True, "1": True, "true": True, "non-hof": False, "nonhof": False,
          "non_hof": False, "0": False, "false": False}


def parse_duration(text: object, name: str = "--mttf", default_unit: str = "min") -> float:
    """``"10m"``, ``"600s"``, ``"1.5h"``, ``"30d"`` -> seconds; a bare number is in
    ``default_unit``. Raises ``ValueError`` naming ``name`` and the text."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), default_unit
    else:
        match = _DURATION.match(str(text))
        if not match:
            fail(name, text, "is not a duration (examples: 10m, 600s, 1.5h, 30d)")
        value, unit = float(match.group(1)), (match.group(2).lower() or default_unit)
    if unit not in _UNITS:
        fail(name, text, f"has an unknown unit {unit!r} (known: {', '.join(_UNITS)})")
    seconds = value * _UNITS[unit]
    positive(name, seconds)
    return seconds


@dataclass(frozen=True)
class FailureTrace:
    """Failure times (seconds since start, ascending) and whether each one is a HOF."""

    times_s: np.ndarray
    is_hof: np.ndarray
    source: str = "trace"

    def __post_init__(self) -> None:
        require(self.times_s.ndim == 1 and self.times_s.shape == self.is_hof.shape,
                "trace", self.source, "needs one kind per failure time")
        require(len(self.times_s) > 0, "trace", self.source, "has no failures")
        require(bool(np.all(self.times_s >= 0)), "trace", self.source,
                "has negative failure times")
        require(bool(np.all(np.diff(self.times_s) >= 0)), "trace", self.source,
                "failure times must be ascending")

    @property
    def span_s(self) -> float:
        return float(self.times_s[-1])

    @property
    def hof_ratio(self) -> float:
        return float(np.mean(self.is_hof))

    @property
    def mttf_s(self) -> float:
        return self.span_s / len(self.times_s)


def load_trace(path: str | Path) -> FailureTrace:
    """Read a ``time,kind`` CSV (see the module docstring)."""
    file = Path(path)
    require(file.is_file(), "--trace", str(path), "is not an existing file")
    times: list[float] = []
    kinds: list[bool] = []
    with file.open(newline="") as handle:
        for lineno, row in enumerate(csv.reader(handle), start=1):
            if not row or not row[0].strip() or row[0].lstrip().startswith("#"):
                continue
            if len(row) < 2:
                fail(f"{file.name}:{lineno}", ",".join(row), "needs two fields: time,kind")
            raw_time, raw_kind = row[0].strip(), row[1].strip().lower()
            try:
                t = float(raw_time)
            except ValueError:
                if not times and raw_time.lower() == "time":   # header
                    continue
                fail(f"{file.name}:{lineno} time", raw_time, "is not a number of seconds")
            if raw_kind not in _KINDS:
                fail(f"{file.name}:{lineno} kind", raw_kind,
                     f"is not one of {', '.join(_KINDS)}")
            times.append(t)
            kinds.append(_KINDS[raw_kind])
    order = np.argsort(np.asarray(times, dtype=float), kind="stable")
    return FailureTrace(np.asarray(times, dtype=float)[order],
                        np.asarray(kinds, dtype=bool)[order], source=str(file))


@dataclass(frozen=True)
class FailureModel:
    """Where failures come from: Poisson(1/mttf) with a HOF share, or a trace."""

    mttf_s: float
    hof_ratio: float = 1.0
    trace: FailureTrace | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        positive("mttf", self.mttf_s)
        fraction("hof_ratio", self.hof_ratio)

    @classmethod
    def per_gpu(cls, gpu_mttf_s: float, n_gpus: int, hof_ratio: float = 1.0) -> FailureModel:
        """Independent GPUs, each failing at 1/gpu_mttf: the job fails n_gpus times as often."""
        positive("--gpu-mttf", gpu_mttf_s)
        int_at_least("n_gpus", n_gpus, 1)
        return cls(gpu_mttf_s / n_gpus, hof_ratio)

    @classmethod
    def from_trace(cls, trace: FailureTrace) -> FailureModel:
        """Rates for the analytic model taken from the trace; sampling replays the trace."""
        return cls(trace.mttf_s, trace.hof_ratio, trace)

    @property
    def rate_per_s(self) -> float:
        return 1.0 / self.mttf_s

    def sample(self, runs: int, horizon_s: float,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Failure times (``runs`` x m, +inf past the horizon) and HOF flags of each run."""
        int_at_least("runs", runs, 1)
        positive("horizon", horizon_s)
        if self.trace is not None:
            keep = self.trace.times_s < horizon_s
            times = np.tile(self.trace.times_s[keep], (runs, 1))
            hof = np.tile(self.trace.is_hof[keep], (runs, 1))
            return times, hof
        expected = horizon_s / self.mttf_s
        width = int(expected + 8 * math.sqrt(expected) + 16)
        while True:
            times = np.cumsum(rng.exponential(self.mttf_s, size=(runs, width)), axis=1)
            if np.all(times[:, -1] >= horizon_s):
                break
            width *= 2
        times[times >= horizon_s] = np.inf
        used = int(np.max(np.sum(np.isfinite(times), axis=1), initial=0))
        times = times[:, :max(used, 1)]
        hof = rng.random(times.shape) < self.hof_ratio
        return times, hof
