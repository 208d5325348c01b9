"""Recipes load, match docs/design.md section 5, and reject bad keys/values by name."""
from __future__ import annotations

from pathlib import Path

import pytest

from leto_lightning.models.config import (
    HofPhase,
    RecipeConfig,
    RecipeError,
    count_parameters,
    list_recipes,
    load_recipe,
    recipe_path,
    recipes_dir,
)

# docs/design.md section 5: total / active parameters (billions) and DP, TP, PP, EP, sharded.
DESIGN = {
    "qwen": (4.0, 4.0, 2, 2, 1, 1, False),
    "olmoe": (6.9, 1.3, 2, 2, 1, 4, True),
    "deepseek_moe": (16.4, 2.8, 8, 8, 1, 16, False),
    "gpt_moe": (20.9, 3.6, 8, 8, 1, 16, True),
    "kimi_moe": (49.1, 3.1, 4, 4, 4, 16, True),
    "deepseek_v2": (236, 21, 8, 8, 16, 16, None),
    "deepseek_v3": (671, 37, 128, 8, 16, 64, None),
    "deepseek_v4": (1600, 49, 1024, 8, 16, 64, None),
}
TRAINABLE = ["qwen", "olmoe", "deepseek_moe", "gpt_moe", "kimi_moe"]
SIM_ONLY = ["deepseek_v2", "deepseek_v3", "deepseek_v4"]


def test_all_recipes_present() -> None:
    assert sorted(DESIGN) == list_recipes()


@pytest.mark.parametrize("name", sorted(DESIGN))
def test_recipe_loads(name: str) -> None:
    recipe = load_recipe(name)
    assert isinstance(recipe, RecipeConfig)
    assert recipe.name == name
    assert recipe.full is not None
    if name in SIM_ONLY:
        assert recipe.size == "full" and recipe.tiny is None
    else:
        assert recipe.size == "tiny" and recipe.active is recipe.tiny


@pytest.mark.parametrize("name", sorted(DESIGN))
def test_full_form_matches_design(name: str) -> None:
    total_b, active_b, dp, tp, pp, ep, sharded = DESIGN[name]
    full = load_recipe(name, ["size=full"]).full
    total, active = count_parameters(full.model)
    assert abs(total / 1e9 - total_b) / total_b < 0.05, (name, total / 1e9)
    assert abs(active / 1e9 - active_b) / active_b < 0.05, (name, active / 1e9)
    par = full.parallelism
    assert (par.dp, par.tp, par.pp, par.ep) == (dp, tp, pp, ep)
    if sharded is not None:
        assert par.sharded_optimizer is sharded
    assert (par.dp * par.tp) % par.ep == 0


def test_deepseek_v4_is_131072_gpus() -> None:
    assert load_recipe("deepseek_v4").full.parallelism.world_size == 131_072


@pytest.mark.parametrize("name", TRAINABLE)
def test_tiny_form_same_kind(name: str) -> None:
    recipe = load_recipe(name)
    tiny, full = recipe.tiny.model, recipe.full.model
    assert 64 <= tiny.d_model <= 128 and 2 <= tiny.n_layers <= 4
    assert 64 <= tiny.seq_len <= 128 and 256 <= tiny.vocab_size <= 512
    assert (tiny.n_experts > 0) == (full.n_experts > 0)
    if full.n_experts:
        assert 4 <= tiny.n_experts <= 8 and tiny.top_k >= 2
    assert (tiny.shared_experts > 0) == (full.shared_experts > 0)
    assert (tiny.dense_layers > 0) == (full.dense_layers > 0)
    assert (tiny.n_kv_heads < tiny.n_heads) == (full.n_kv_heads < full.n_heads)
    par = recipe.tiny.parallelism
    assert (par.dp, par.tp, par.pp, par.ep) == (2, 1, 1, 1)


def test_overrides() -> None:
    recipe = load_recipe("olmoe", ["trainer.max_steps=100", "faults.hof_every=10",
                                   "faults.hof_phase=update", "optimizer.lr=1e-3"])
    assert recipe.trainer.max_steps == 100
    assert recipe.faults.hof_every == 10 and recipe.faults.hof_phase == HofPhase.update
    assert recipe.optimizer.lr == pytest.approx(1e-3)
    full = load_recipe("olmoe", ["size=full"])
    assert full.active is full.full and full.active.model.n_experts == 64


@pytest.mark.parametrize("override,key", [
    ("trainer.max_stepz=5", "trainer.max_stepz"),
    ("bogus=1", "bogus"),
    ("tiny.model.n_expertz=4", "tiny.model.n_expertz"),
])
def test_unknown_key_is_named(override: str, key: str) -> None:
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe("olmoe", [override])


@pytest.mark.parametrize("override,key", [
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("tiny.parallelism.sharded_optimizer=maybe", "tiny.parallelism.sharded_optimizer"),
    ("faults.hof_phase=sometimes", "faults.hof_phase"),
])
def test_wrong_type_is_named(override: str, key: str) -> None:
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe("olmoe", [override])


@pytest.mark.parametrize("recipe,override,key", [
    ("olmoe", "tiny.model.n_heads=3", "tiny.model.n_heads"),
    ("olmoe", "tiny.model.top_k=9", "tiny.model.top_k"),
    ("olmoe", "full.parallelism.ep=3", "full.parallelism.ep"),
    ("olmoe", "tiny.data.global_batch=20", "tiny.data.global_batch"),
    ("olmoe", "size=medium", "size"),
    ("deepseek_v3", "size=tiny", "size"),
    ("qwen", "trainer.precision=fp8", "trainer.precision"),
])
def test_invalid_value_is_named(recipe: str, override: str, key: str) -> None:
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(recipe, [override])


def test_recipe_error_is_value_error() -> None:
    assert issubclass(RecipeError, ValueError)
    with pytest.raises(ValueError, match="not found"):
        load_recipe("no_such_recipe")


def test_path_and_env_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = recipe_path("qwen")
    assert recipe_path("qwen.yaml") == source and recipe_path(str(source)) == source
    copy = tmp_path / "mine.yaml"
    copy.write_text(source.read_text().replace("name: qwen", "name: mine"))
    assert load_recipe(str(copy)).name == "mine"
    monkeypatch.setenv("LETO_RECIPES_DIR", str(tmp_path))
    assert recipes_dir() == tmp_path and list_recipes() == ["mine"]
    assert load_recipe("mine").name == "mine"


def test_lightning_kwargs() -> None:
    trainer = load_recipe("olmoe", ["trainer.val_check_interval=10"]).trainer
    kwargs = trainer.lightning_kwargs()
    assert kwargs["val_check_interval"] == 10 and kwargs["check_val_every_n_epoch"] is None
    assert "val_check_interval" not in load_recipe("olmoe").trainer.lightning_kwargs()


def test_one_schema_for_trainer_and_simulator() -> None:
    """The simulator reads a recipe with the trainer's schema: the same classes, rules and counts."""
    from leto_lightning.errors import ConfigurationError
    from leto_lightning.recipes import ModelConfig, parameter_counts
    from leto_lightning.sim.workload import ModelSpec, load_workload

    assert ModelSpec is ModelConfig and issubclass(RecipeError, ConfigurationError)
    recipe = load_recipe("deepseek_moe", ["size=full"]).full
    workload = load_workload("deepseek_moe")
    assert workload.model == recipe.model
    assert (parameter_counts(recipe.model).total, parameter_counts(recipe.model).active) == \
        count_parameters(recipe.model)
    for key, value in (("n_kv_heads", 0), ("expert_ffn_hidden", 0), ("d_model", 2.5)):  # no shorthand, ints only
        with pytest.raises(RecipeError, match=f"model.{key}={value!r}"):
            ModelConfig(**{**vars(recipe.model), key: value})
