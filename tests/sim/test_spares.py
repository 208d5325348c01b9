"""leto+spares: hot spare nodes for non-HOFs (``sim/spares.py``).

Invariants: equal to Leto when every failure is a HOF or the pool is empty, never below Leto,
Leto's checkpoint path when the pool runs dry; the pool replay of the Monte Carlo agrees with
Erlang's loss formula; transfer times are bytes over bandwidth; bad settings are named.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from leto_lightning.cli import main
from leto_lightning.errors import ConfigurationError, UsageError
from leto_lightning.sim.ettr import analytic, monte_carlo
from leto_lightning.sim.failures import FailureModel
from leto_lightning.sim.hardware import get_hardware
from leto_lightning.sim.report import SimSettings, evaluate, make_context
from leto_lightning.sim.spares import SpareConfig, erlang_b, parse_spares, plan, state_split
from leto_lightning.sim.startup import StartupModel
from leto_lightning.sim.systems import SYSTEMS, SystemContext, SystemKnobs
from leto_lightning.sim.workload import BUILTIN_WORKLOADS, with_parallelism

ANALYTIC = SimSettings(monte_carlo=False)
MTTF = 600.0


def _ctx(name: str = "deepseek_v4", comm: str = "scalable", spares: SpareConfig | None = None,
         gpus: int | None = None, hardware: str = "a100") -> SystemContext:
    wl = BUILTIN_WORKLOADS[name] if gpus is None else with_parallelism(BUILTIN_WORKLOADS[name],
                                                                       n_gpus=gpus)
    return make_context(wl, get_hardware(hardware), startup=StartupModel(comm_init=comm),
                        knobs=SystemKnobs(spares=spares or SpareConfig()))


def _ettrs(ctx: SystemContext, hof: float) -> tuple[float, float]:
    fm = FailureModel(MTTF, hof)
    leto = evaluate(ctx, "leto", fm, settings=ANALYTIC).analytic
    spares = evaluate(ctx, "leto+spares", fm, settings=ANALYTIC).analytic
    assert leto and spares
    return leto.ettr, spares.ettr


CONTEXTS = [("deepseek_v4", "scalable", None), ("deepseek_v4", "stock", None),
            ("deepseek_v3", "scalable", None), ("kimi_moe", "scalable", None),
            ("deepseek_moe", "stock", None), ("deepseek_v4", "scalable", 8192)]


@pytest.mark.parametrize("name, comm, gpus", CONTEXTS)
def test_equal_to_leto_when_every_failure_is_a_hof(name: str, comm: str, gpus: int | None) -> None:
    leto, spares = _ettrs(_ctx(name, comm, gpus=gpus), 1.0)
    assert spares == pytest.approx(leto, rel=1e-12)


@pytest.mark.parametrize("name, comm, gpus", CONTEXTS)
@pytest.mark.parametrize("spares", [SpareConfig(), SpareConfig(nodes=4, repair_s=3600.0),
                                    SpareConfig(nodes=1)])
def test_never_below_leto(name: str, comm: str, gpus: int | None, spares: SpareConfig) -> None:
    ctx = _ctx(name, comm, spares, gpus)
    for hof in (0.0, 0.25, 0.5, 0.9, 1.0):
        leto, with_spares = _ettrs(ctx, hof)
        assert with_spares >= leto - 1e-12, hof


@pytest.mark.parametrize("hof", [0.0, 0.5, 0.9])
def test_without_spare_nodes_it_is_leto(hof: float) -> None:
    ctx = _ctx(spares=SpareConfig(nodes=0))
    leto, spares = _ettrs(ctx, hof)
    assert spares == pytest.approx(leto, rel=1e-12)
    schedule = SYSTEMS["leto+spares"].schedule(replace(ctx, failures=FailureModel(MTTF, hof)), 3)
    assert schedule.nonhof_modes == SYSTEMS["leto"].schedule(ctx, 3).nonhof_modes


def test_spares_remove_the_rollback_at_131k_gpus() -> None:
    """The headline setting: half of the failures non-HOFs, default pool; no rollback left."""
    leto, spares = _ettrs(_ctx(), 0.5)
    assert spares > leto + 0.03
    r = evaluate(_ctx(), "leto+spares", FailureModel(MTTF, 0.5), settings=ANALYTIC)
    assert r.schedule and r.schedule.spares and r.schedule.spares.blocking < 1e-50
    assert all(m.rollback == "iteration" for p, m in r.schedule.nonhof_modes if p > 1e-12)


def test_pool_replay_hands_out_spares_until_none_is_back() -> None:
    pool = plan(SpareConfig(nodes=2, repair_s=100.0), BUILTIN_WORKLOADS["deepseek_v4"],
                get_hardware("a100"), 0.0)
    times = np.array([[0.0, 10.0, 20.0, 30.0, 105.0, 150.0, np.inf]])
    nonhof = np.array([[True, True, True, False, True, True, True]])
    found = pool.found_spare(times, nonhof)
    # spares 1, 2 taken at 0 and 10; 20 finds none; 30 is a HOF; 105: back from 0; 150: from 10
    assert found.tolist() == [[True, True, False, False, True, True, False]]


def test_pool_replay_agrees_with_erlang() -> None:
    """Poisson non-HOFs, 2 spares, offered load 2: Erlang B(2, 2) = 0.4 of them find none."""
    assert erlang_b(2, 2.0) == pytest.approx(0.4)
    assert erlang_b(1, 3.0) == pytest.approx(0.75) and erlang_b(0, 1.0) == 1.0
    assert erlang_b(5, 0.0) == 0.0
    rng = np.random.default_rng(1)
    times = np.cumsum(rng.exponential(1.0, size=(4, 20_000)), axis=1)
    pool = plan(SpareConfig(nodes=2, repair_s=2.0), BUILTIN_WORKLOADS["deepseek_v4"],
                get_hardware("a100"), 1.0)
    found = pool.found_spare(times, np.ones(times.shape, dtype=bool))
    assert pool.blocking == pytest.approx(0.4)
    assert 1 - found.mean() == pytest.approx(0.4, abs=0.01)


def test_exhausted_pool_falls_back_to_the_checkpoint_path() -> None:
    """One spare that never comes back: every non-HOF after the first takes Leto's checkpoint
    restart; analytic and Monte Carlo both land on Leto's ETTR."""
    ctx = _ctx(spares=SpareConfig(nodes=1, repair_s=1e12, tier3="on"))
    fm = FailureModel(MTTF, 0.5)
    schedule = SYSTEMS["leto+spares"].schedule(replace(ctx, failures=fm), 3)
    leto = SYSTEMS["leto"].schedule(ctx, 3)
    (p_spare, _), (p_empty, empty) = schedule.nonhof_modes
    assert p_empty > 1 - 1e-6 and p_spare < 1e-6
    fallback = leto.nonhof_modes[0][1]
    assert (empty.duration_s, empty.rollback) == (fallback.duration_s, "checkpoint")
    assert analytic(schedule, MTTF, 0.5).ettr == pytest.approx(
        analytic(leto, MTTF, 0.5).ettr, abs=2e-3)   # the encode cost of tier 3 remains
    mc = monte_carlo(schedule, fm, 10 * 86400.0, runs=4, seed=2)
    assert mc.ettr == pytest.approx(analytic(leto, MTTF, 0.5).ettr, abs=5e-3)


def test_monte_carlo_pool_agrees_with_the_analytic_model(kimi_ctx: SystemContext) -> None:
    """Kimi-MoE, two spares, repair 40 min: B(2, 2) = 0.4 of non-HOFs find the pool empty."""
    fm = FailureModel(MTTF, 0.5)
    ctx = replace(kimi_ctx, failures=fm,
                  knobs=SystemKnobs(spares=SpareConfig(nodes=2, repair_s=2400.0, tier3="on")))
    schedule = SYSTEMS["leto+spares"].schedule(ctx, 20)
    assert schedule.spares and schedule.spares.blocking == pytest.approx(0.4)
    runs = monte_carlo(schedule, fm, 30 * 86400.0, runs=16, seed=7)
    assert abs(runs.ettr - analytic(schedule, MTTF, 0.5).ettr) < 0.005


@pytest.mark.parametrize("net", [25.0, 50.0, 100.0])
def test_transfer_time_is_state_bytes_over_bandwidth(net: float) -> None:
    wl = BUILTIN_WORKLOADS["deepseek_v3"]
    hw = get_hardware("a100", {"net_gbps": net})
    cfg = SpareConfig(tier3="on")
    split = state_split(wl, hw)
    pool = plan(cfg, wl, hw, 1e-3)
    bandwidth = net * hw.comm_efficiency * 1e9
    assert split.replicated > 0 and split.unreplicated > 0
    assert pool.copy_s == pytest.approx(split.replicated / bandwidth)
    assert pool.rebuild_s == pytest.approx(cfg.tier3_k * split.unreplicated / bandwidth)
    assert pool.encode_s == pytest.approx(cfg.tier3_m * split.unreplicated / bandwidth)
    assert pool.parity_host_gb == pytest.approx(split.unreplicated / cfg.tier3_k / 1e9)
    mode = SYSTEMS["leto+spares"].schedule(
        replace(_ctx("deepseek_v3"), hardware=hw, failures=FailureModel(MTTF, 0.5),
                knobs=SystemKnobs(spares=cfg)), 5).nonhof_modes[0][1]
    assert mode.load_s == pytest.approx(pool.transfer_s)


def test_replicated_state_needs_no_tier3() -> None:
    """DeepSeek-MoE does not shard its optimizer: all state has a DP copy on another node."""
    split = state_split(BUILTIN_WORKLOADS["deepseek_moe"], get_hardware("a100"))
    assert split.unreplicated == 0 and split.replicated > 0
    pool = plan(SpareConfig(tier3="on"), BUILTIN_WORKLOADS["deepseek_moe"], get_hardware("a100"),
                1e-3)
    assert not pool.tier3 and pool.encode_s == 0 and pool.usable
    # a one-node job keeps its only copies on the node it loses
    qwen = plan(SpareConfig(), BUILTIN_WORKLOADS["qwen"], get_hardware("a100"), 1e-3)
    assert qwen.replicated_gb == 0 and qwen.stripe_k == 0 and not qwen.usable


def test_leto_spares_needs_the_failure_rate() -> None:
    with pytest.raises(UsageError, match="failure rate"):
        SYSTEMS["leto+spares"].schedule(_ctx(), 3)


@pytest.mark.parametrize("kw, fragment", [
    ({"nodes": -1}, "--spares=-1"), ({"share": 1.5}, "--spares='150%'"),
    ({"repair_s": 0.0}, "--spare-repair=0.0"), ({"join_s": -2.0}, "--spare-join=-2.0"),
    ({"tier3": "maybe"}, "--tier3='maybe'"), ({"tier3_k": 0}, "spares.tier3_k=0"),
    ({"tier3_overlap": 2.0}, "spares.tier3_overlap=2.0")])
def test_bad_spare_settings_are_named(kw: dict, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment.replace("+", r"\+")):
        SpareConfig(**kw)


def test_parse_spares() -> None:
    assert parse_spares("16") == (16, 0.02)
    assert parse_spares("5%") == (None, pytest.approx(0.05))
    assert SpareConfig(share=0.02).pool_nodes(16384) == 328
    with pytest.raises(ConfigurationError, match="--spares='lots'"):
        parse_spares("lots")
    with pytest.raises(ConfigurationError, match="--spares='2.5'"):
        parse_spares("2.5")


def test_cli_prints_the_four_systems(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--recipe", "deepseek_v4", "--gpus", "131072", "--hof-ratio", "0.5",
                 "--comm-init", "scalable", "--systems", "leto,leto+spares,gemini+,checkpoint",
                 "--no-monte-carlo"])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for system in ("leto", "leto+spares", "gemini+", "checkpoint"):
        assert system in rows and "%" in rows[system], system
    assert "328 hot spare nodes" in out


def test_cli_json_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--recipe", "deepseek_v3", "--systems", "leto+spares", "--json",
                 "--no-monte-carlo", "--hof-ratio", "0.5", "--spares", "64",
                 "--spare-repair", "12h", "--tier3", "on"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    spares = data["systems"][0]["schedule"]["spares"]
    assert spares["nodes"] == 64 and spares["repair_s"] == 12 * 3600 and spares["tier3"]
    assert data["knobs"]["spares"]["nodes"] == 64
    for argv, fragment in ((["--spares", "x"], "--spares='x'"),
                           (["--spare-repair", "soon"], "--spare-repair='soon'")):
        assert main(["simulate", "--systems", "leto+spares", "--no-monte-carlo", *argv]) == 2
        assert fragment in capsys.readouterr().err
