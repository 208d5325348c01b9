"""Workloads: parameter counts, recipe loading with fallbacks, scaling, bad input."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from leto_lightning.sim.workload import (
    BUILTIN_WORKLOADS,
    DESIGN_PARAMS,
    DataSpec,
    ModelSpec,
    ParallelSpec,
    Workload,
    count_parameters,
    load_workload,
    recipes_dir,
    with_parallelism,
)

RECIPES_PRESENT = all((recipes_dir() / f"{n}.yaml").is_file() for n in BUILTIN_WORKLOADS)


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_builtin_counts_match_design_table(name: str) -> None:
    counts = BUILTIN_WORKLOADS[name].params
    total, active = DESIGN_PARAMS[name]
    assert counts.total == pytest.approx(total * 1e9, rel=0.05)
    assert counts.active == pytest.approx(active * 1e9, rel=0.05)


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_counts_agree_with_the_models_package(name: str) -> None:
    """sim counts on its own; the result must equal the recipes' convention (models.config)."""
    models = pytest.importorskip("leto_lightning.models.config")
    m = BUILTIN_WORKLOADS[name].model
    cfg = models.ModelConfig(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})
    total, active = models.count_parameters(cfg)
    assert (count_parameters(m).total, count_parameters(m).active) == (total, active)


@pytest.mark.skipif(not RECIPES_PRESENT, reason="recipes/*.yaml not present")
@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_yaml_recipes_equal_the_builtins(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_workload(name)
    builtin = BUILTIN_WORKLOADS[name]
    assert (loaded.model, loaded.parallel, loaded.data) == \
        (builtin.model, builtin.parallel, builtin.data)
    assert loaded.source.endswith(f"{name}.yaml")


def test_missing_yaml_falls_back_to_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LETO_RECIPES_DIR", str(tmp_path))
    wl = load_workload("deepseek_v4")
    assert wl.source == "builtin" and wl.n_gpus == 131072


def test_incomplete_yaml_is_filled_and_warned(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "olmoe.yaml").write_text("name: olmoe\nfull:\n  model:\n    seq_len: 2048\n")
    monkeypatch.setenv("LETO_RECIPES_DIR", str(tmp_path))
    with pytest.warns(UserWarning, match="lacks"):
        wl = load_workload("olmoe")
    assert wl.model.seq_len == 2048
    assert wl.model.n_experts == BUILTIN_WORKLOADS["olmoe"].model.n_experts


def test_yaml_far_from_design_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "qwen.yaml").write_text("name: qwen\nfull:\n  model:\n    n_layers: 18\n")
    monkeypatch.setenv("LETO_RECIPES_DIR", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_workload("qwen")
    assert any("off docs/design.md" in str(w.message) for w in caught)


def test_tiny_form_from_a_yaml_path() -> None:
    if not RECIPES_PRESENT:
        pytest.skip("recipes/*.yaml not present")
    wl = load_workload(str(recipes_dir() / "olmoe.yaml"), size="tiny")
    assert wl.model.d_model < 1024 and wl.n_gpus == 2


def test_scaling_dp_keeps_work_per_replica() -> None:
    base = BUILTIN_WORKLOADS["deepseek_v4"]
    small = with_parallelism(base, n_gpus=16384)
    assert small.parallel.dp == 128 and small.n_gpus == 16384
    assert small.data.global_batch * base.parallel.dp == base.data.global_batch * 128
    assert small.micro_batches == base.micro_batches


@pytest.mark.parametrize("build, fragment", [
    (lambda: ModelSpec(vocab_size=100, d_model=-64, n_layers=2, n_heads=2, ffn_hidden=8,
                       seq_len=16), "model.d_model=-64"),
    (lambda: ModelSpec(vocab_size=100, d_model=64, n_layers=0, n_heads=2, ffn_hidden=8,
                       seq_len=16), "model.n_layers=0"),
    (lambda: DataSpec(global_batch=-3), "data.global_batch=-3"),
    (lambda: ParallelSpec(dp=-1), "parallelism.dp=-1"),
    (lambda: ParallelSpec(dp=2, tp=2, ep=3), "parallelism.ep=3"),
    (lambda: load_workload("no_such_recipe"), "--recipe='no_such_recipe'"),
    (lambda: load_workload("missing/file.yaml"), "--recipe='missing/file.yaml'"),
    (lambda: with_parallelism(BUILTIN_WORKLOADS["kimi_moe"], n_gpus=100, dp=2, tp=2, pp=2),
     "--gpus=100"),
    (lambda: with_parallelism(BUILTIN_WORKLOADS["kimi_moe"], n_gpus=100), "--gpus=100"),
    (lambda: with_parallelism(BUILTIN_WORKLOADS["kimi_moe"], tp=-2), "--tp=-2"),
])
def test_bad_input_names_the_value(build, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as err:
        build()
    assert fragment in str(err.value)


def test_dense_model_rejects_expert_parallelism() -> None:
    qwen = BUILTIN_WORKLOADS["qwen"]
    with pytest.raises(ValueError, match="parallelism.ep=2"):
        Workload("x", qwen.model, ParallelSpec(dp=2, tp=1, ep=2), qwen.data)
