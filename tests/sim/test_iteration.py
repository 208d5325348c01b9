"""Iteration-time and memory model: sanity, monotonicity, composition."""

from __future__ import annotations

import math

import pytest

from leto_lightning.sim.hardware import BUILTIN_HARDWARE, get_hardware
from leto_lightning.sim.iteration import NO_OVERLAP, checkpoint_bytes_per_gpu, gpu_share, iteration_time, memory_per_gpu
from leto_lightning.sim.workload import BUILTIN_WORKLOADS, load_workload, with_parallelism


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
@pytest.mark.parametrize("hw", ["a100", "h100", "h200"])
def test_breakdown_is_positive_and_sums(name: str, hw: str) -> None:
    b = iteration_time(BUILTIN_WORKLOADS[name], get_hardware(hw))
    parts = [v for k, v in b.as_dict().items() if k != "total_s"]
    assert all(v >= 0 and math.isfinite(v) for v in parts)
    assert b.total_s == pytest.approx(sum(parts))
    assert b.compute_s > 0


def test_faster_hardware_is_faster() -> None:
    wl = BUILTIN_WORKLOADS["kimi_moe"]
    assert iteration_time(wl, get_hardware("h100")).total_s < \
        iteration_time(wl, get_hardware("a100")).total_s


def test_overlap_only_helps() -> None:
    wl, hw = BUILTIN_WORKLOADS["deepseek_v3"], get_hardware("a100")
    assert iteration_time(wl, hw, NO_OVERLAP).total_s > iteration_time(wl, hw).total_s


def test_more_micro_batches_shrink_the_bubble_share() -> None:
    wl, hw = BUILTIN_WORKLOADS["deepseek_v2"], get_hardware("a100")
    big = with_parallelism(wl, n_gpus=wl.n_gpus * 2)       # DP x2, batch x2: same per replica
    b1, b2 = iteration_time(wl, hw), iteration_time(big, hw)
    assert b2.bubble_s == pytest.approx(b1.bubble_s, rel=1e-9)
    assert b1.bubble_s / b1.total_s < 0.2


def test_sharded_optimizer_divides_the_optimizer_state() -> None:
    wl = BUILTIN_WORKLOADS["deepseek_v3"]
    share = gpu_share(wl)
    assert share.shard < share.weights / 10
    assert checkpoint_bytes_per_gpu(wl) == pytest.approx(12 * share.shard)


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_full_recipes_fit_an_80gb_gpu(name: str) -> None:
    assert memory_per_gpu(BUILTIN_WORKLOADS[name]).total_gb < 80


def test_cpu_profile_gives_finite_times_for_a_tiny_recipe() -> None:
    pytest.importorskip("omegaconf")
    from leto_lightning.sim.workload import recipes_dir
    if not (recipes_dir() / "olmoe.yaml").is_file():
        pytest.skip("recipes not present")
    wl = load_workload("olmoe", size="tiny")
    t = iteration_time(wl, BUILTIN_HARDWARE["cpu"]).total_s
    assert 0 < t < 60
