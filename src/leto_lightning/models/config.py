"""The recipe schema as the model code imports it: the names of ``leto_lightning.recipes``.

The schema itself (dataclasses, ``load_recipe``, ``count_parameters``) lives in
``leto_lightning.recipes``, a pure module the simulator reads too; this module only gives the
model, the trainer and the benchmarks their familiar import path.
"""
from __future__ import annotations

from ..recipes import (
    DataConfig,
    FaultsConfig,
    HofPhase,
    LetoSection,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    RecipeConfig,
    RecipeError,
    SizeForm,
    TrainerConfig,
    count_parameters,
    list_recipes,
    load_recipe,
    recipe_path,
    recipes_dir,
)

__all__ = [
    "DataConfig",
    "FaultsConfig",
    "HofPhase",
    "LetoSection",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "RecipeConfig",
    "RecipeError",
    "SizeForm",
    "TrainerConfig",
    "count_parameters",
    "list_recipes",
    "load_recipe",
    "recipe_path",
    "recipes_dir",
]
