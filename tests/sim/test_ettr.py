"""ETTR: Monte Carlo vs analytic agreement, closed forms, determinism.

Stated tolerance: with 16 runs of 30 simulated days, the Monte Carlo mean ETTR is within
0.5 percentage points of the analytic expectation (measured gaps are below 0.2 points), and
within 4 standard errors where the analytic model is exact (no shadow-rebuild wait).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from leto_lightning.sim.ettr import analytic, analytic_ettr, monte_carlo
from leto_lightning.sim.failures import FailureModel
from leto_lightning.sim.hardware import get_hardware
from leto_lightning.sim.report import make_context
from leto_lightning.sim.startup import StartupModel
from leto_lightning.sim.systems import SYSTEMS, RecoveryMode, Schedule, SystemKnobs
from leto_lightning.sim.workload import BUILTIN_WORKLOADS

TOLERANCE = 0.005
HORIZON = 30 * 86400.0

CASES = [  # (system, knob, hof ratio, knobs)
    ("gemini", 11, 1.0, SystemKnobs()),
    ("gemini+", 11, 1.0, SystemKnobs()),
    ("checkpoint", 11, 1.0, SystemKnobs()),
    ("moevement", 4, 1.0, SystemKnobs()),
    ("leto", 11, 1.0, SystemKnobs()),
    ("leto", 40, 0.6, SystemKnobs(leto_fallback=0.05)),
    ("leto", 40, 0.3, SystemKnobs(leto_tier2=True)),
]


@pytest.mark.parametrize("system, knob, hof, knobs", CASES)
def test_monte_carlo_agrees_with_analytic_kimi(kimi_ctx, system, knob, hof, knobs) -> None:  # type: ignore[no-untyped-def]
    ctx = make_context(kimi_ctx.workload, kimi_ctx.hardware, knobs=knobs,
                       iteration_s=kimi_ctx.iteration_s)
    schedule = SYSTEMS[system].schedule(ctx, knob)
    expected = analytic(schedule, 600.0, hof)
    runs = monte_carlo(schedule, FailureModel(600.0, hof), HORIZON, runs=16, seed=3)
    assert abs(runs.ettr - expected.ettr) < TOLERANCE
    if schedule.shadow_rebuild_s == 0:
        assert abs(runs.ettr - expected.ettr) < 4 * runs.stderr + 5e-4
    assert runs.recovery_s == pytest.approx(expected.recovery_s, rel=0.05)


@pytest.mark.parametrize("comm, hof", [("stock", 1.0), ("scalable", 1.0), ("scalable", 0.5)])
def test_monte_carlo_agrees_at_131k_gpus(comm: str, hof: float) -> None:
    """DeepSeek-V4: shadow-pool waits make the analytic model approximate; still within 0.5."""
    ctx = make_context(BUILTIN_WORKLOADS["deepseek_v4"], get_hardware("a100"),
                       startup=StartupModel(comm_init=comm))
    schedule = SYSTEMS["leto"].schedule(ctx, 5)
    runs = monte_carlo(schedule, FailureModel(600.0, hof), HORIZON, runs=16, seed=11)
    assert abs(runs.ettr - analytic(schedule, 600.0, hof).ettr) < TOLERANCE


def test_same_seed_same_runs(kimi_ctx) -> None:  # type: ignore[no-untyped-def]
    schedule = SYSTEMS["leto"].schedule(kimi_ctx, 20)
    fm = FailureModel(600.0, 0.7)
    a = monte_carlo(schedule, fm, 7 * 86400, runs=4, seed=5)
    b = monte_carlo(schedule, fm, 7 * 86400, runs=4, seed=5)
    c = monte_carlo(schedule, fm, 7 * 86400, runs=4, seed=6)
    assert np.array_equal(a.ettr_runs, b.ettr_runs)
    assert not np.array_equal(a.ettr_runs, c.ettr_runs)


def _schedule(interval: int, rollback: str, recovery: float, ckpt: float = 5.0) -> Schedule:
    mode = RecoveryMode("r", recovery, rollback=rollback)
    return Schedule("x", interval, interval, 10.0, 10.0, ckpt, ((1.0, mode),), ((1.0, mode),))


@pytest.mark.parametrize("interval, mttf, recovery", [(10, 600, 60), (1, 300, 5), (50, 3600, 200)])
def test_checkpoint_rollback_matches_the_classical_closed_form(interval: int, mttf: float,
                                                               recovery: float) -> None:
    """Restart-to-checkpoint with failures during recovery: E[segment] = (e^{lL}-1)(1/l + D),
    D = (e^{lR}-1)/l (Daly 2006, exponential failures)."""
    lam, length = 1 / mttf, interval * 10.0 + 5.0
    d = math.expm1(lam * recovery) / lam
    expected = interval * 10.0 / (math.expm1(lam * length) * (1 / lam + d))
    got = analytic_ettr(_schedule(interval, "checkpoint", recovery), mttf, 1.0)[0]
    assert got == pytest.approx(expected, rel=1e-10)


def test_in_place_rollback_matches_the_per_iteration_closed_form() -> None:
    lam, T, R, n, c = 1 / 600, 10.0, 20.0, 25, 5.0
    d = math.expm1(lam * R) / lam
    per_unit = lambda u: math.expm1(lam * u) * (1 / lam + d)
    expected = n * T / (n * per_unit(T) + per_unit(c))
    got = analytic_ettr(_schedule(n, "iteration", R, c), 600.0, 1.0)[0]
    assert got == pytest.approx(expected, rel=1e-10)


def test_no_failures_limit_is_the_fault_free_overhead() -> None:
    s = _schedule(10, "checkpoint", 60.0)
    assert analytic_ettr(s, 1e15, 1.0)[0] == pytest.approx(100 / 105, rel=1e-6)


def test_breakdown_adds_up(kimi_ctx) -> None:  # type: ignore[no-untyped-def]
    a = analytic(SYSTEMS["gemini"].schedule(kimi_ctx, 11), 600.0, 1.0)
    assert a.recovery_s == pytest.approx(a.init_s + a.recompute_s)
    assert a.overhead > 0
