"""``leto train RECIPE [key=value ...]``: train a recipe's model with Leto under ``leto launch``.

The recipe (``recipes/<name>.yaml`` or a path) is validated with its overrides, written
resolved to ``RUN_DIR/recipe.yaml``, and the package's recipe training script runs on
``parallelism.dp`` CPU ranks with shadows. ``faults.hof_every=N`` injects a HOF every N
iterations (``faults.hof_phase``: compute, update or random), each once shadows are ready
(``faults.plan.hof_faults``). A recipe this command cannot run is a ``ConfigurationError``.
"""

from __future__ import annotations

import argparse
import os
import time

from .console import notice
from .errors import ConfigurationError
from .faults.plan import hof_faults


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a recipe (recipes/*.yaml) on CPU ranks with in-place recovery",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe name (qwen, olmoe, deepseek_moe, gpt_moe, kimi_moe) or a YAML path")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. size=tiny trainer.max_steps=100")
    p.add_argument("--run-dir", default=None, help="outputs (default: leto-runs/<recipe>-<time>)")
    p.add_argument("--heartbeat-timeout", type=float, default=60.0)
    p.add_argument("--trainer", choices=("lightning", "accelerate"), default="lightning",
                   help="the training loop: Trainer(strategy='leto') or LetoAccelerator (docs/accelerate.md)")
    p.set_defaults(func=run)


def _load(load_recipe, name: str, overrides):
    """``load_recipe``, with a file that is not YAML named in one line."""
    import yaml

    try:
        return load_recipe(name, overrides)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigurationError(f"recipe {name!r} is not valid YAML ({problem}{where}): fix the file") from None


def _check_retained_settings(leto, ranks: int) -> None:
    """The recipe's ``leto.*`` settings, checked as the trainers will use them -- before any
    trainer starts (else each start fails the same way, restart after restart)."""
    from .retained.config import RetainedConfig

    try:
        config = RetainedConfig(page_bytes=leto.page_bytes, data_pages=leto.data_pages,
                                tier1_parity=leto.tier1_parity, tier2_parity=leto.tier2_parity)
        config.check_devices(ranks)
    except ValueError as exc:
        raise ConfigurationError(f"recipe setting leto.*: {exc}") from None


def run(args: argparse.Namespace) -> int:
    return build_agent(args.recipe, args.overrides, args.run_dir, args.heartbeat_timeout,
                       trainer=args.trainer).run()


def build_agent(recipe_name: str, overrides, run_dir: str | None = None, heartbeat_timeout: float = 60.0, out=None,
                trainer: str = "lightning"):
    """The agent that trains ``recipe_name`` with ``overrides`` (validated here)."""
    from omegaconf import OmegaConf

    from .env import warm_template_enabled
    from .examples import ACCELERATE_TRAIN, RECIPE_TRAIN
    from .models.config import load_recipe
    from .runtime.agent import Agent, LaunchSpec
    from .runtime.config import RuntimeConfig
    from .runtime.storage import atomic_write, run_dir_path, usable_run_dir

    recipe = _load(load_recipe, recipe_name, overrides)
    par = recipe.active.parallelism
    _check_retained_settings(recipe.leto, par.dp)
    if par.tp != 1 or par.pp != 1:
        raise ConfigurationError(f"leto train runs data parallelism on CPU: {recipe.name} size={recipe.size} has "
                                 f"tp={par.tp}, pp={par.pp}; use size=tiny (or the simulator for full sizes: "
                                 f"leto simulate --recipe {recipe.name})")
    if trainer == "accelerate" and recipe.trainer.strategy != "leto":
        raise ConfigurationError(f"trainer.strategy={recipe.trainer.strategy!r} is a Lightning strategy: use it with "
                                 "--trainer lightning (the default), or drop it for --trainer accelerate")
    run_dir = run_dir or os.path.join("leto-runs", f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    usable_run_dir(run_dir)
    resolved = run_dir_path(run_dir, "recipe.yaml")  # a link in its place is refused, never written through
    atomic_write(resolved, lambda tmp: OmegaConf.save(OmegaConf.structured(recipe), tmp), mode=0o600)
    faults = hof_faults(recipe.faults.hof_every, str(recipe.faults.hof_phase.value), recipe.trainer.max_steps,
                        par.dp, recipe.faults.seed)
    script, script_args = (ACCELERATE_TRAIN, ["--recipe", resolved]) if trainer == "accelerate" else (RECIPE_TRAIN,
                                                                                                     [resolved])
    spec = LaunchSpec(script=script, args=script_args, nproc_per_node=par.dp, run_dir=run_dir, faults=faults)
    config = RuntimeConfig(heartbeat_timeout=heartbeat_timeout, shadow_level=recipe.leto.shadow_level,
                           warm_template=warm_template_enabled())
    notice(f"training {recipe.name} ({recipe.size}) on {par.dp} CPU ranks; {len(faults)} HOFs planned; "
           f"run dir {run_dir}")
    return Agent(spec, config, out=out)
