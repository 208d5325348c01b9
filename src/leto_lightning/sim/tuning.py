"""Tuning each system's knob for ETTR: the checkpoint interval I (the paper's Table 4), or
MoEvement's sparse window W.

The tuner evaluates the analytic ETTR on a geometric grid of intervals, then narrows the best
bracket with an integer golden-section search. ``brute_force`` scans every value and is what the
tests compare against. Young's (1974) and Daly's (2006) formulas give the classical optimum for
systems that roll back to the last checkpoint, and serve as an analytic check: for such systems
the exponential model's optimum does not depend on the recovery cost, so the tuned interval
should agree with Daly's to within an iteration or so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from leto_lightning.sim.checks import positive
from leto_lightning.sim.ettr import analytic_ettr
from leto_lightning.sim.systems import SystemContext, SystemModel

_PHI = (math.sqrt(5.0) - 1.0) / 2.0
Curve = Callable[[np.ndarray], np.ndarray]   # knob values -> analytic ETTR


def young_interval(checkpoint_s: float, mttf_s: float, iteration_s: float) -> float:
    """Young: interval sqrt(2 * c * MTTF), in iterations."""
    positive("iteration_s", iteration_s)
    return math.sqrt(2.0 * checkpoint_s * mttf_s) / iteration_s


def daly_interval(checkpoint_s: float, mttf_s: float, iteration_s: float) -> float:
    """Daly's higher-order estimate of the optimal compute time between checkpoints, in
    iterations: sqrt(2cM) * (1 + sqrt(c/2M)/3 + c/(18M)) - c for c < 2M, else M."""
    positive("iteration_s", iteration_s)
    c, m = checkpoint_s, mttf_s
    if c >= 2 * m:
        return m / iteration_s
    tau = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    return tau / iteration_s


@dataclass(frozen=True)
class TuneResult:
    """The best knob value found for one system."""

    system: str
    knob: str
    param: int
    ettr: float
    young: float | None   # Young's interval (iterations), checkpoint systems only
    evaluations: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _interval_ettr(model: SystemModel, ctx: SystemContext, mttf_s: float,
                   hof_ratio: float) -> Curve:
    base = model.schedule(ctx, 1)
    return lambda ints: analytic_ettr(base, mttf_s, hof_ratio, np.asarray(ints))


def _window_ettr(model: SystemModel, ctx: SystemContext, mttf_s: float, hof_ratio: float,
                 params: np.ndarray) -> np.ndarray:
    return np.array([analytic_ettr(model.schedule(ctx, int(w)), mttf_s, hof_ratio)[0]
                     for w in params])


def brute_force(model: SystemModel, ctx: SystemContext, mttf_s: float, hof_ratio: float,
                max_param: int | None = None) -> tuple[int, float]:
    """Scan every knob value in [1, max_param]; the first maximum wins."""
    top = max_param or model.max_param(ctx)
    params = np.arange(1, top + 1)
    if model.knob == "window":
        values = _window_ettr(model, ctx, mttf_s, hof_ratio, params)
    else:
        values = _interval_ettr(model, ctx, mttf_s, hof_ratio)(params)
    best = int(np.argmax(values))
    return int(params[best]), float(values[best])


def _golden(f: Curve, lo: int, hi: int) -> tuple[int, float, int]:
    """Integer golden-section search for the max of a unimodal ``f`` on [lo, hi]."""
    calls = 0
    cache: dict[int, float] = {}

    def val(x: int) -> float:
        nonlocal calls
        if x not in cache:
            cache[x] = float(f(np.array([x]))[0])
            calls += 1
        return cache[x]

    while hi - lo > 3:
        a = hi - round(_PHI * (hi - lo))
        b = lo + round(_PHI * (hi - lo))
        if a >= b:
            break
        if val(a) < val(b):
            lo = a
        else:
            hi = b
    best = max(range(lo, hi + 1), key=lambda x: (val(x), -x))
    return best, val(best), calls


def tune(model: SystemModel, ctx: SystemContext, mttf_s: float, hof_ratio: float,
         max_param: int | None = None) -> TuneResult:
    """The knob value maximizing the analytic ETTR."""
    top = max_param or model.max_param(ctx)
    if model.knob == "window":
        param, ettr = brute_force(model, ctx, mttf_s, hof_ratio, top)
        return TuneResult(model.name, model.knob, param, ettr, None, top)
    f = _interval_ettr(model, ctx, mttf_s, hof_ratio)
    grid = np.unique(np.round(np.geomspace(1, top, num=min(top, 64))).astype(int))
    values = f(grid)
    i = int(np.argmax(values))
    lo = int(grid[max(i - 1, 0)])
    hi = int(grid[min(i + 1, len(grid) - 1)])
    param, ettr, calls = _golden(f, lo, hi)
    if values[i] > ettr:        # never worse than the grid point itself
        param, ettr = int(grid[i]), float(values[i])
    base = model.schedule(ctx, 1)
    young = young_interval(base.checkpoint_s, mttf_s, base.iteration_s) \
        if base.checkpoint_s > 0 else None
    return TuneResult(model.name, model.knob, param, ettr, young, len(grid) + calls)
