"""Validation against measurements: iteration time (the paper's Table 6 analog) and ETTR (against
fault-injection results, the paper's Table 3 until this project's benchmark produces its own).

Measurements live in ``docs/sim/measured.json``::

    {"iteration_time": [{"recipe": "olmoe", "size": "full", "hardware": "a100",
                         "measured_s": 12.002, "global_batch": 182, "source": "..."}, ...],
     "ettr": [{"recipe": "kimi_moe", "hardware": "a100", "system": "gemini", "interval": 11,
               "mttf_s": 600, "hof_ratio": 1.0, "iteration_s": 9.097,
               "measured_ettr": 0.741, "measured_recovery_s": 127, "source": "..."}, ...]}

An iteration entry may override ``global_batch``, ``micro_batch``, ``seq_len``, ``dp``, ``tp``,
``pp``, ``ep`` and ``hw`` (hardware field overrides); ``global_batch: null`` means the batch of
the measurement is unknown: no error is computed, and the batch at which the model reproduces the
measurement is reported instead. ``include_comm: false`` compares against the model without its
communication terms (a single-rank measurement).

``docs/sim/measured_tiny.json`` (``{recipe: seconds}``, written by
``benchmarks/tiny_step_time.py``: one rank of each tiny recipe, one thread, plain torch, no
communication, on this project's CPU machine) is read as well when it sits beside the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from leto_lightning.sim.checks import require
from leto_lightning.sim.ettr import analytic
from leto_lightning.sim.hardware import HardwareProfile, get_hardware
from leto_lightning.sim.iteration import iteration_time
from leto_lightning.sim.report import make_context
from leto_lightning.sim.systems import get_system
from leto_lightning.sim.workload import Workload, load_workload, with_parallelism

MEASURED_PATH = Path(__file__).resolve().parents[3] / "docs" / "sim" / "measured.json"
TINY_NAME = "measured_tiny.json"
TINY_SOURCE = ("benchmarks/tiny_step_time.py on this project's CPU machine (one rank, one "
               "thread, plain torch, no communication)")


def _tiny_entries(file: Path) -> list[dict[str, object]]:
    tiny = file.with_name(TINY_NAME)
    if not tiny.is_file():
        return []
    try:
        data = json.loads(tiny.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"measured file={str(tiny)!r} is not valid JSON: {exc}") from exc
    require(isinstance(data, dict), "measured file", str(tiny), "must map recipe -> seconds")
    return [{"recipe": name, "size": "tiny", "hardware": "cpu", "measured_s": seconds,
             "include_comm": False, "source": TINY_SOURCE} for name, seconds in sorted(data.items())]


def load_measured(path: Path | str | None = None) -> dict[str, list]:
    """The measurements file (``docs/sim/measured.json`` by default)."""
    file = Path(path) if path else MEASURED_PATH
    require(file.is_file(), "measured file", str(file), "does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"measured file={str(file)!r} is not valid JSON: {exc}") from exc
    require(isinstance(data, dict), "measured file", str(file), "must hold a JSON object")
    return {"iteration_time": list(data.get("iteration_time", [])) + _tiny_entries(file),
            "ettr": list(data.get("ettr", []))}


def entry_workload(entry: dict[str, object], batch: int | None = None) -> Workload:
    """The recipe of a measurement with the entry's overrides applied."""
    wl = load_workload(str(entry["recipe"]), str(entry.get("size", "full")))
    degrees = {k: entry.get(k) for k in ("dp", "tp", "pp", "ep")}
    if any(v is not None for v in degrees.values()):
        wl = with_parallelism(wl, **degrees)  # type: ignore[arg-type]
    model: dict[str, Any] = {k: entry[k] for k in ("seq_len",) if entry.get(k) is not None}
    data: dict[str, Any] = {k: entry[k] for k in ("micro_batch",) if entry.get(k) is not None}
    gb = batch if batch is not None else entry.get("global_batch")
    if gb is not None:
        data["global_batch"] = gb
    return replace(wl, model=replace(wl.model, **model), data=replace(wl.data, **data))


def entry_hardware(entry: dict[str, object]) -> HardwareProfile:
    return get_hardware(str(entry.get("hardware", "a100")), entry.get("hw") or None)  # type: ignore[arg-type]


def implied_global_batch(entry: dict[str, object], measured_s: float) -> int:
    """Smallest global batch (a multiple of dp x micro_batch) whose predicted iteration time
    reaches ``measured_s``."""
    probe = entry_workload(entry, batch=1)
    hw = entry_hardware(entry)
    step = probe.parallel.dp * probe.data.micro_batch
    lo, hi = 1, 1
    while iteration_time(entry_workload(entry, hi * step), hw).total_s < measured_s and hi < 2**20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if iteration_time(entry_workload(entry, mid * step), hw).total_s < measured_s:
            lo = mid
        else:
            hi = mid
    return hi * step


@dataclass(frozen=True)
class IterationRow:
    """One line of the Table 6 analog."""

    recipe: str
    size: str
    hardware: str
    measured_s: float
    global_batch: int | None
    predicted_s: float | None
    error: float | None             # predicted / measured - 1
    implied_batch: int | None
    reference_predicted_s: float | None
    source: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def iteration_rows(path: Path | str | None = None) -> list[IterationRow]:
    """Predicted vs measured iteration time for every entry of the measurements file."""
    rows = []
    for entry in load_measured(path)["iteration_time"]:
        measured = float(entry["measured_s"])
        known = "global_batch" not in entry or entry["global_batch"] is not None
        predicted = error = implied = None
        if known:
            wl = entry_workload(entry)
            b = iteration_time(wl, entry_hardware(entry))
            predicted = b.total_s
            if entry.get("include_comm") is False:
                predicted -= b.tp_s + b.ep_s + b.dp_s + b.pp_s
            error = predicted / measured - 1.0
            entry = {**entry, "global_batch": wl.data.global_batch}
        else:
            implied = implied_global_batch(entry, measured)
        rows.append(IterationRow(
            str(entry["recipe"]), str(entry.get("size", "full")), str(entry.get("hardware", "a100")),
            measured, entry.get("global_batch"), predicted, error, implied,
            entry.get("paper_predicted_s"), str(entry.get("source", ""))))
    return rows


@dataclass(frozen=True)
class EttrRow:
    """Predicted vs measured ETTR and recovery time of one fault-injection result."""

    recipe: str
    system: str
    interval: int
    measured_ettr: float
    predicted_ettr: float
    measured_recovery_s: float | None
    predicted_recovery_s: float
    source: str

    @property
    def error_points(self) -> float:
        return 100.0 * (self.predicted_ettr - self.measured_ettr)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "error_points": self.error_points}


def ettr_rows(path: Path | str | None = None) -> list[EttrRow]:
    """Analytic ETTR at the measured setting (interval, MTTF, HOF share, iteration time)."""
    rows = []
    for entry in load_measured(path)["ettr"]:
        wl = entry_workload(entry)
        iteration = entry.get("iteration_s")
        ctx = make_context(wl, entry_hardware(entry),
                           iteration_s=float(iteration) if iteration else None)
        schedule = get_system(str(entry["system"])).schedule(ctx, int(entry["interval"]))
        result = analytic(schedule, float(entry["mttf_s"]), float(entry.get("hof_ratio", 1.0)))
        rec = entry.get("measured_recovery_s")
        rows.append(EttrRow(str(entry["recipe"]), schedule.system, int(entry["interval"]),
                            float(entry["measured_ettr"]), result.ettr,
                            float(rec) if rec is not None else None, result.recovery_s,
                            str(entry.get("source", ""))))
    return rows
