"""The recipe schema: the structured configs of the workload recipes in ``recipes/``.

One schema for every reader of a recipe: the trainer and the model (``leto_lightning.models``),
the simulator (``leto_lightning.sim``, which reads only the ``model``, ``parallelism`` and
``data`` sections of a size form) and the benchmarks. A pure module: it imports neither torch
nor Lightning (omegaconf only where a YAML file is loaded), so the simulator can use it.

Why structured configs: a typo in a key (``trainer.max_stepz=5``) or a wrong type
(``trainer.max_steps=abc``) must fail loudly, naming the key, instead of silently training
with a default. ``load_recipe`` merges the YAML and the dotlist overrides into
``OmegaConf.structured`` schemas in struct mode, then instantiates these frozen dataclasses,
whose ``__post_init__`` checks what types alone cannot (divisibility, ranges, choices) and
raises ``RecipeError`` (a ``ConfigurationError``) naming the key and the value.

Conventions (docs/models.md, the header of every ``recipes/*.yaml``): every field is explicit
(``n_kv_heads`` and ``expert_ffn_hidden`` have no "0 means another field" shorthand);
parameter counts (``parameter_counts``) take untied embedding and LM head in total and active,
attention q/k/v/o with ``head_dim = d_model / n_heads`` (GQA through ``n_kv_heads``), SwiGLU
FFNs (3 matrices), two RMSNorms per layer plus a final one, one router per MoE layer; layer
``i`` is MoE iff ``n_experts > 0 and i >= dense_layers and i % moe_every == 0``.
GPUs = dp * tp * pp; ep splits the routed experts inside the dp*tp ranks of one stage.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .env import RECIPES_DIR
from .errors import ConfigurationError

if TYPE_CHECKING:
    from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "DataConfig",
    "FaultsConfig",
    "HofPhase",
    "LetoSection",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ParamCounts",
    "RecipeConfig",
    "RecipeError",
    "SizeForm",
    "TrainerConfig",
    "count_parameters",
    "list_recipes",
    "load_recipe",
    "parameter_counts",
    "recipe_path",
    "recipes_dir",
]

PRECISIONS = ("32-true", "32", "64-true", "64", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
SCHEDULERS = ("none", "cosine")


class RecipeError(ConfigurationError):
    """A recipe could not be loaded: unknown key, wrong type or invalid value (named).

    A ``ConfigurationError``, so also a ``ValueError`` (what the simulator's checks raise)."""


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise RecipeError naming ``key`` and ``value`` unless ``ok``."""
    if not ok:
        raise RecipeError(f"{key}={value!r}: {why}")


def _int_at_least(key: str, value: Any, low: int) -> None:
    """An integer (not a bool) >= ``low``: a schema built in code gets no type check from omegaconf."""
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= low, key, value,
             f"must be an integer >= {low}")


class HofPhase(str, Enum):
    """Where an injected HOF lands: the forward/backward pass, the optimizer update, or either."""

    compute = "compute"
    update = "update"
    random = "random"


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape; ``n_experts == 0`` means a dense model."""

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_hidden: int = 512
    expert_ffn_hidden: int = 0
    n_experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    moe_every: int = 1
    dense_layers: int = 0
    seq_len: int = 128

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                    "ffn_hidden", "moe_every", "seq_len"):
            _int_at_least(f"model.{key}", getattr(self, key), 1)
        for key in ("expert_ffn_hidden", "n_experts", "top_k", "shared_experts", "dense_layers"):
            _int_at_least(f"model.{key}", getattr(self, key), 0)
        _require(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
                 f"must divide d_model={self.d_model}")
        _require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                 f"must divide n_heads={self.n_heads} (grouped-query attention)")
        if self.n_experts > 0:
            _require(1 <= self.top_k <= self.n_experts, "model.top_k", self.top_k,
                     f"must be in 1..n_experts={self.n_experts}")
            _require(self.expert_ffn_hidden >= 1, "model.expert_ffn_hidden",
                     self.expert_ffn_hidden, "must be >= 1 for an MoE model")

    @property
    def head_dim(self) -> int:
        """Per-head width; the schema fixes it at d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        """True when at least one layer is a mixture of experts."""
        return any(self.layer_is_moe(i) for i in range(self.n_layers))

    def layer_is_moe(self, index: int) -> bool:
        """DeepSeek's rule: MoE iff past the leading dense layers and on the moe_every stride."""
        return self.n_experts > 0 and index >= self.dense_layers and index % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        """How many layers are a mixture of experts."""
        return sum(self.layer_is_moe(i) for i in range(self.n_layers))


@dataclass(frozen=True)
class ParallelismConfig:
    """GPUs = dp * tp * pp; ep splits the experts inside the dp*tp ranks of one stage."""

    dp: int = 2
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sharded_optimizer: bool = False

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "ep"):
            _int_at_least(f"parallelism.{key}", getattr(self, key), 1)
        _require((self.dp * self.tp) % self.ep == 0, "parallelism.ep", self.ep,
                 f"must divide dp*tp={self.dp * self.tp} (EP lives inside the DP*TP group)")

    @property
    def world_size(self) -> int:
        """Number of GPUs (ranks) of the job."""
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class DataConfig:
    """Batch sizes in sequences: global across data-parallel ranks, micro per rank and step."""

    global_batch: int = 16
    micro_batch: int = 8

    def __post_init__(self) -> None:
        _int_at_least("data.micro_batch", self.micro_batch, 1)
        _int_at_least("data.global_batch", self.global_batch, 1)


@dataclass(frozen=True)
class SizeForm:
    """One size of a workload (``full`` or ``tiny``): model shape, parallelism and batch."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        par, model, data = self.parallelism, self.model, self.data
        # a recipe trains whole steps; the simulator's DataSpec may model fewer sequences than a
        # micro-batch (it rounds up to one), so this check belongs to the form, not to DataConfig
        _require(data.global_batch >= data.micro_batch, "data.global_batch", data.global_batch,
                 f"must be >= micro_batch={data.micro_batch}")
        per_step = par.dp * data.micro_batch
        _require(data.global_batch % per_step == 0, "data.global_batch", data.global_batch,
                 f"must be a multiple of dp*micro_batch={per_step}")
        _require(model.n_heads % par.tp == 0, "model.n_heads", model.n_heads,
                 f"must be divisible by parallelism.tp={par.tp}")
        _require(model.vocab_size % par.tp == 0, "model.vocab_size", model.vocab_size,
                 f"must be divisible by parallelism.tp={par.tp}")
        _require(model.n_layers >= par.pp, "parallelism.pp", par.pp,
                 f"exceeds n_layers={model.n_layers}")
        if model.n_experts > 0:
            _require(model.n_experts % par.ep == 0, "parallelism.ep", par.ep,
                     f"must divide n_experts={model.n_experts}")

    @property
    def grad_accumulation(self) -> int:
        """Micro-batches each data-parallel rank accumulates per optimizer step."""
        return self.data.global_batch // (self.parallelism.dp * self.data.micro_batch)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings. ``scheduler``/``warmup_steps``/``min_lr_ratio`` are optional extras.

    They are not written in the recipe files (whose schema is shared with the simulator)
    but can be set by override, e.g. ``optimizer.scheduler=cosine optimizer.warmup_steps=5``.
    """

    name: str = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    scheduler: str = "none"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _require(self.name.lower() == "adamw", "optimizer.name", self.name,
                 "only 'adamw' is supported")
        _require(self.lr > 0, "optimizer.lr", self.lr, "must be > 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 "optimizer.betas", list(self.betas), "must be two numbers in [0, 1)")
        _require(self.eps > 0, "optimizer.eps", self.eps, "must be > 0")
        _require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay,
                 "must be >= 0")
        _require(self.scheduler in SCHEDULERS, "optimizer.scheduler", self.scheduler,
                 f"must be one of {SCHEDULERS}")
        _require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps,
                 "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", self.min_lr_ratio,
                 "must be in [0, 1]")


TRAINER_STRATEGIES = ("leto", "leto_fsdp2")  # the Lightning strategy names of the integration


@dataclass(frozen=True)
class TrainerConfig:
    """The subset of Lightning ``Trainer`` arguments a recipe fixes, plus the global seed."""

    max_steps: int = 50
    max_epochs: int = -1
    precision: str = "32-true"
    gradient_clip_val: float = 1.0
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 1
    val_check_interval: int = 0
    seed: int = 1234
    devices: int = 2
    strategy: str = "leto"  # "leto" (DDP) or "leto_fsdp2" (FSDP2: fully_shard per block)

    def __post_init__(self) -> None:
        _require(self.strategy in TRAINER_STRATEGIES, "trainer.strategy", self.strategy,
                 f"must be one of {TRAINER_STRATEGIES}")
        _require(self.max_steps >= -1, "trainer.max_steps", self.max_steps, "must be >= -1")
        _require(self.max_epochs >= -1, "trainer.max_epochs", self.max_epochs, "must be >= -1")
        _require(self.precision in PRECISIONS, "trainer.precision", self.precision,
                 f"must be one of {PRECISIONS}")
        _require(self.gradient_clip_val >= 0, "trainer.gradient_clip_val",
                 self.gradient_clip_val, "must be >= 0 (0 = no clipping)")
        for key in ("accumulate_grad_batches", "log_every_n_steps", "devices"):
            _require(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key),
                     "must be >= 1")
        _require(self.val_check_interval >= 0, "trainer.val_check_interval",
                 self.val_check_interval, "must be >= 0 (0 = once per epoch)")

    def lightning_kwargs(self) -> dict:
        """Arguments for ``lightning.Trainer`` (devices/strategy are the integration's call)."""
        kwargs: dict = dict(
            max_steps=self.max_steps, max_epochs=self.max_epochs, precision=self.precision,
            gradient_clip_val=self.gradient_clip_val or None,
            accumulate_grad_batches=self.accumulate_grad_batches,
            log_every_n_steps=self.log_every_n_steps,
        )
        if self.val_check_interval > 0:
            # An int interval counts steps across epochs only with check_val_every_n_epoch=None.
            kwargs.update(val_check_interval=self.val_check_interval, check_val_every_n_epoch=None)
        return kwargs


@dataclass(frozen=True)
class FaultsConfig:
    """Fault injection for tests and benchmarks: a HOF every ``hof_every`` iterations."""

    hof_every: int = 0
    hof_phase: HofPhase = HofPhase.compute
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.hof_every >= 0, "faults.hof_every", self.hof_every, "must be >= 0")


@dataclass(frozen=True)
class LetoSection:
    """Retained-state protection and shadow settings (docs/design.md 2.1-2.4)."""

    page_bytes: int = 65536
    data_pages: int = 8
    tier1_parity: int = 2
    tier2_parity: int = 1
    shadow_level: int = 3

    def __post_init__(self) -> None:
        _require(self.page_bytes >= 64 and self.page_bytes % 64 == 0, "leto.page_bytes",
                 self.page_bytes, "must be a positive multiple of 64")
        _require(self.data_pages >= 1, "leto.data_pages", self.data_pages, "must be >= 1")
        for key in ("tier1_parity", "tier2_parity"):
            _require(getattr(self, key) >= 0, f"leto.{key}", getattr(self, key), "must be >= 0")
        _require(self.data_pages + self.tier1_parity <= 255, "leto.tier1_parity",
                 self.tier1_parity, "data_pages + parity must be <= 255 (GF(2^8))")
        _require(self.shadow_level in (1, 2, 3), "leto.shadow_level", self.shadow_level,
                 "must be 1, 2 or 3")


@dataclass(frozen=True)
class RecipeConfig:
    """A whole workload recipe; ``active`` is the size form selected by ``size``."""

    name: str = ""
    size: str = "tiny"
    full: SizeForm | None = None
    tiny: SizeForm | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    leto: LetoSection = field(default_factory=LetoSection)

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", self.name, "must be a non-empty string")
        _require(self.size in ("full", "tiny"), "size", self.size, "must be 'full' or 'tiny'")
        _require(getattr(self, self.size) is not None, "size", self.size,
                 f"recipe {self.name!r} has no {self.size!r} form")

    @property
    def active(self) -> SizeForm:
        """The size form to build and train (``full`` or ``tiny``)."""
        form = getattr(self, self.size)
        assert form is not None  # guaranteed by __post_init__
        return form


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a ``ModelConfig`` by part; ``total``/``active`` as the recipes count."""

    embedding: int      # input embedding + LM head + final norm
    attention: int      # attention + its two norms, all layers
    dense_ffn: int      # dense FFN layers
    shared: int         # shared experts + routers (dense-like, computed for every token)
    routed: int         # all routed experts
    routed_active: int  # routed experts one token uses (top_k per MoE layer)

    @property
    def non_expert(self) -> int:
        """Weights sharded like a dense model (TP x PP)."""
        return self.embedding + self.attention + self.dense_ffn + self.shared

    @property
    def total(self) -> int:
        return self.non_expert + self.routed

    @property
    def active(self) -> int:
        """What one token's forward pass touches: all but the routed experts it does not select."""
        return self.non_expert + self.routed_active


def parameter_counts(model: ModelConfig) -> ParamCounts:
    """Analytic parameter counts by part; ``total`` equals the built model's numel."""
    d, hd = model.d_model, model.head_dim
    attn = 2 * d * model.n_heads * hd + 2 * d * model.n_kv_heads * hd + 2 * d
    expert = 3 * d * model.expert_ffn_hidden
    moe = model.n_moe_layers
    return ParamCounts(
        embedding=2 * model.vocab_size * d + d,
        attention=attn * model.n_layers,
        dense_ffn=3 * d * model.ffn_hidden * (model.n_layers - moe),
        shared=moe * (expert * model.shared_experts + d * model.n_experts),
        routed=moe * expert * model.n_experts,
        routed_active=moe * expert * model.top_k,
    )


def count_parameters(model: ModelConfig) -> tuple[int, int]:
    """Analytic (total, active) parameter counts (``parameter_counts`` has them by part)."""
    counts = parameter_counts(model)
    return counts.total, counts.active


def recipes_dir() -> Path:
    """``$LETO_RECIPES_DIR`` if set, else the repository's ``recipes/`` beside ``src/``."""
    env = os.environ.get(RECIPES_DIR)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "recipes"


def list_recipes() -> list[str]:
    """Names of the recipes in ``recipes_dir()``, sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_path(path_or_name: str) -> Path:
    """Resolve ``olmoe``, ``olmoe.yaml`` or a path to an existing recipe file."""
    direct = Path(path_or_name).expanduser()
    if direct.is_file():
        return direct
    name = path_or_name if path_or_name.endswith((".yaml", ".yml")) else f"{path_or_name}.yaml"
    candidate = recipes_dir() / name
    if candidate.is_file():
        return candidate
    raise RecipeError(f"recipe {path_or_name!r} not found (looked for {direct} and "
                      f"{candidate}; known: {', '.join(list_recipes()) or 'none'})")


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    """One-line message naming the offending key (omegaconf keeps it in ``full_key``)."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None)
    text = str(err).split("\n")[0].strip()
    return f"{key}: {text}" if key else text


def _instantiate(merged: Any) -> Any:
    """``OmegaConf.to_object``, first per size form so a bad value names ``tiny.``/``full.``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for form in ("full", "tiny"):
        if merged[form] is None:
            continue
        try:
            OmegaConf.to_object(merged[form])
        except RecipeError as err:
            raise RecipeError(f"{form}.{err}") from None
        except OmegaConfBaseException as err:
            cause = err.__cause__ or err.__context__
            if isinstance(cause, RecipeError):
                raise RecipeError(f"{form}.{cause}") from None
            raise
    return OmegaConf.to_object(merged)


def load_recipe(path_or_name: str, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Load a recipe, apply dotlist ``overrides`` (``trainer.max_steps=100``) and validate.

    Raises ``RecipeError`` naming the key for unknown keys, wrong types and invalid values.
    """
    from omegaconf import OmegaConf  # imported here: the simulator imports this module without loading YAML
    from omegaconf.errors import OmegaConfBaseException

    path = recipe_path(path_or_name)
    schema = OmegaConf.structured(RecipeConfig)
    OmegaConf.set_struct(schema, True)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(path))
        if overrides:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        recipe = _instantiate(merged)
    except RecipeError as err:
        raise RecipeError(f"{path.name}: {err}") from None
    except OmegaConfBaseException as err:
        cause = err.__cause__ or err.__context__
        if isinstance(cause, RecipeError):  # raised in a __post_init__ during to_object
            raise RecipeError(f"{path.name}: {cause}") from None
        raise RecipeError(f"{path.name}: {_omegaconf_message(err)}") from err
    assert isinstance(recipe, RecipeConfig)
    return recipe
