"""Tuning: the tuner finds the brute-force optimum; Young/Daly agree for rollback systems."""

from __future__ import annotations

import pytest

from leto_lightning.sim.hardware import get_hardware
from leto_lightning.sim.report import make_context
from leto_lightning.sim.systems import SYSTEMS, SystemKnobs
from leto_lightning.sim.tuning import brute_force, daly_interval, tune, young_interval
from leto_lightning.sim.workload import BUILTIN_WORKLOADS

PAPER_T = {"qwen": 3.556, "olmoe": 12.002, "gpt_moe": 5.363, "kimi_moe": 9.097}


def _ctx(name: str, **knobs):  # type: ignore[no-untyped-def]
    return make_context(BUILTIN_WORKLOADS[name], get_hardware("a100"),
                        knobs=SystemKnobs(max_interval=3000, **knobs), iteration_s=PAPER_T[name])


@pytest.mark.parametrize("name", sorted(PAPER_T))
@pytest.mark.parametrize("system, hof", [("gemini", 1.0), ("gemini+", 1.0), ("checkpoint", 1.0),
                                         ("leto", 0.5), ("leto", 0.9), ("moevement", 1.0)])
@pytest.mark.parametrize("mttf", [600.0, 3600.0])
def test_tuner_finds_the_brute_force_optimum(name: str, system: str, hof: float,
                                             mttf: float) -> None:
    ctx = _ctx(name, leto_fallback=0.02)
    model = SYSTEMS[system]
    if model.supported(ctx):
        pytest.skip("system does not support the workload")
    best_param, best_ettr = brute_force(model, ctx, mttf, hof)
    found = tune(model, ctx, mttf, hof)
    assert found.ettr == pytest.approx(best_ettr, rel=1e-12, abs=1e-12)
    assert found.param == best_param or found.ettr == pytest.approx(best_ettr, abs=1e-12)
    assert found.evaluations < 200


@pytest.mark.parametrize("name", sorted(PAPER_T))
@pytest.mark.parametrize("mttf", [600.0, 1800.0, 3600.0])
def test_rollback_systems_land_on_daly(name: str, mttf: float) -> None:
    ctx = _ctx(name)
    for system in ("gemini", "gemini+"):
        found = tune(SYSTEMS[system], ctx, mttf, 1.0)
        sched = SYSTEMS[system].schedule(ctx, 1)
        daly = daly_interval(sched.checkpoint_s, mttf, sched.iteration_s)
        assert abs(found.param - daly) <= max(1.0, 0.05 * daly)
        assert found.young == pytest.approx(young_interval(sched.checkpoint_s, mttf,
                                                           sched.iteration_s))


def test_gemini_and_gemini_plus_share_their_interval() -> None:
    """The optimum of a restart-to-checkpoint system does not depend on its recovery cost."""
    ctx = _ctx("kimi_moe")
    assert tune(SYSTEMS["gemini"], ctx, 600, 1.0).param == tune(SYSTEMS["gemini+"], ctx, 600,
                                                                1.0).param


def test_leto_without_rollbacks_checkpoints_as_rarely_as_allowed() -> None:
    ctx = _ctx("kimi_moe")
    assert tune(SYSTEMS["leto"], ctx, 600, 1.0).param == ctx.knobs.max_interval
