"""Workloads: model architecture, parallelism and batch, and their parameter counts.

A workload comes from ``recipes/<name>.yaml`` (only ``<size>.model``, ``<size>.parallelism`` and
``<size>.data`` are read, with omegaconf) or from the built-in definitions below, which carry the
same numbers as the recipes' ``full`` forms so the simulator works without the YAML files.
Parameter counts follow the recipes' convention (``recipes/*.yaml`` header,
``docs/models.md``): untied embedding and LM head counted in total and active; attention
q/k/v/o with ``head_dim = d_model / n_heads`` (GQA through ``n_kv_heads``); SwiGLU FFNs
(3 matrices); two RMSNorms per layer plus a final one; one router per MoE layer; layer ``i`` is
MoE iff ``n_experts > 0 and i >= dense_layers and i % moe_every == 0``.

Parallelism: GPUs = dp * tp * pp; ep splits the routed experts inside the dp*tp ranks of one
pipeline stage (Megatron "MoE parallel folding", expert tensor parallelism 1).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from leto_lightning.sim.checks import fail, int_at_least, require

_MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
               "expert_ffn_hidden", "n_experts", "top_k", "shared_experts", "moe_every",
               "dense_layers", "seq_len")


@dataclass(frozen=True)
class ModelSpec:
    """Transformer architecture (the recipes' ``model:`` schema)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    seq_len: int
    n_experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    moe_every: int = 1
    dense_layers: int = 0
    n_kv_heads: int = 0          # 0: same as n_heads
    expert_ffn_hidden: int = 0   # 0: same as ffn_hidden

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "moe_every"):
            int_at_least(f"model.{key}", getattr(self, key), 1)
        for key in ("ffn_hidden", "n_experts", "top_k", "shared_experts", "dense_layers",
                    "n_kv_heads", "expert_ffn_hidden"):
            int_at_least(f"model.{key}", getattr(self, key), 0)
        require(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
                f"must divide d_model={self.d_model}")
        require(self.kv_heads <= self.n_heads and self.n_heads % self.kv_heads == 0,
                "model.n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if self.n_experts:
            require(1 <= self.top_k <= self.n_experts, "model.top_k", self.top_k,
                    f"must be in [1, n_experts={self.n_experts}] for a MoE model")
            require(self.expert_hidden >= 1, "model.expert_ffn_hidden", self.expert_ffn_hidden,
                    "must be >= 1 (or ffn_hidden >= 1) for a MoE model")
        if self.n_moe_layers < self.n_layers:
            require(self.ffn_hidden >= 1, "model.ffn_hidden", self.ffn_hidden,
                    "must be >= 1: the model has dense FFN layers")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def expert_hidden(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    def layer_is_moe(self, index: int) -> bool:
        return self.n_experts > 0 and index >= self.dense_layers and index % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.layer_is_moe(i) for i in range(self.n_layers))


@dataclass(frozen=True)
class ParallelSpec:
    """Parallelism degrees (the recipes' ``parallelism:`` schema) plus virtual pipeline stages."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sharded_optimizer: bool = False
    vpp: int = 1   # interleaved (virtual) pipeline stages per rank; 1 = plain 1F1B

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "ep", "vpp"):
            int_at_least(f"parallelism.{key}", getattr(self, key), 1)
        require((self.dp * self.tp) % self.ep == 0, "parallelism.ep", self.ep,
                f"must divide dp*tp={self.dp * self.tp} (EP lives inside the DP*TP group)")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """Data-parallel degree of the expert weights (replicas of one expert shard)."""
        return self.dp * self.tp // self.ep


@dataclass(frozen=True)
class DataSpec:
    """Batch (the recipes' ``data:`` schema): sequences per iteration and per micro-batch."""

    global_batch: int
    micro_batch: int = 1

    def __post_init__(self) -> None:
        int_at_least("data.global_batch", self.global_batch, 1)
        int_at_least("data.micro_batch", self.micro_batch, 1)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by part; ``total``/``active`` match the recipes' convention."""

    embedding: int      # input embedding + LM head + final norm
    attention: int      # attention + its norms, all layers
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
        return self.non_expert + self.routed_active


def count_parameters(model: ModelSpec) -> ParamCounts:
    """Analytic parameter counts (same rule as ``leto_lightning.models.config``)."""
    d, hd = model.d_model, model.head_dim
    attn = 2 * d * model.n_heads * hd + 2 * d * model.kv_heads * hd + 2 * d
    expert = 3 * d * model.expert_hidden
    moe = model.n_moe_layers
    return ParamCounts(
        embedding=2 * model.vocab_size * d + d,
        attention=attn * model.n_layers,
        dense_ffn=3 * d * model.ffn_hidden * (model.n_layers - moe),
        shared=moe * (expert * model.shared_experts + d * model.n_experts),
        routed=moe * expert * model.n_experts,
        routed_active=moe * expert * model.top_k,
    )


@dataclass(frozen=True)
class Workload:
    """A training job: architecture, parallelism and batch."""

    name: str
    model: ModelSpec
    parallel: ParallelSpec
    data: DataSpec
    source: str = "builtin"

    def __post_init__(self) -> None:
        m, p = self.model, self.parallel
        require(m.n_heads % p.tp == 0, "parallelism.tp", p.tp,
                f"must divide n_heads={m.n_heads} (tensor parallelism splits heads)")
        if m.n_experts:
            require(m.n_experts % p.ep == 0, "parallelism.ep", p.ep,
                    f"must divide n_experts={m.n_experts}")
        else:
            require(p.ep == 1, "parallelism.ep", p.ep, "must be 1 for a dense model")
        require(p.pp <= m.n_layers, "parallelism.pp", p.pp,
                f"must be <= n_layers={m.n_layers}")

    @property
    def n_gpus(self) -> int:
        return self.parallel.n_gpus

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel replica per iteration (at least 1)."""
        per_replica = self.data.global_batch / (self.parallel.dp * self.data.micro_batch)
        return max(1, math.ceil(per_replica - 1e-9))

    @property
    def tokens_per_iteration(self) -> int:
        return self.micro_batches * self.parallel.dp * self.data.micro_batch * self.model.seq_len

    @cached_property
    def params(self) -> ParamCounts:
        return count_parameters(self.model)

    def describe(self) -> str:
        p = self.parallel
        return (f"{self.name}: {self.params.total / 1e9:.1f}B total / "
                f"{self.params.active / 1e9:.1f}B active, {self.n_gpus:,} GPUs "
                f"(DP{p.dp} TP{p.tp} PP{p.pp} EP{p.ep}"
                f"{', sharded optimizer' if p.sharded_optimizer else ''})")


# docs/design.md section 5: total / active parameters in billions.
DESIGN_PARAMS: dict[str, tuple[float, float]] = {
    "qwen": (4.0, 4.0), "olmoe": (6.9, 1.3), "deepseek_moe": (16.4, 2.8),
    "gpt_moe": (20.9, 3.6), "kimi_moe": (49.1, 3.1), "deepseek_v2": (236.0, 21.0),
    "deepseek_v3": (671.0, 37.0), "deepseek_v4": (1600.0, 49.0),
}


def _builtin(name: str, model: dict, par: dict, data: dict) -> Workload:
    return Workload(name, ModelSpec(**model), ParallelSpec(**par), DataSpec(**data))


def _moe(d: int, layers: int, heads: int, ffn: int, eh: int, experts: int, k: int, shared: int,
         dense: int, vocab: int, seq: int, kv: int = 0) -> dict:
    return dict(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv or heads,
                ffn_hidden=ffn, expert_ffn_hidden=eh, n_experts=experts, top_k=k,
                shared_experts=shared, dense_layers=dense, seq_len=seq)


# Same numbers as the recipes' full forms (recipes/*.yaml, where each architecture choice is
# explained); kept in code so the simulator does not depend on those files.
BUILTIN_WORKLOADS: dict[str, Workload] = {
    "qwen": _builtin("qwen", dict(vocab_size=151936, d_model=2560, n_layers=36, n_heads=32,
                                  n_kv_heads=8, ffn_hidden=9728, seq_len=4096),
                     dict(dp=2, tp=2, pp=1, ep=1), dict(global_batch=512, micro_batch=2)),
    "olmoe": _builtin("olmoe", _moe(2048, 16, 16, 8192, 1024, 64, 8, 0, 0, 50304, 4096),
                      dict(dp=2, tp=2, pp=1, ep=4, sharded_optimizer=True),
                      dict(global_batch=1024, micro_batch=4)),
    "deepseek_moe": _builtin(
        "deepseek_moe", _moe(2048, 28, 16, 10944, 1408, 64, 6, 2, 1, 102400, 4096),
        dict(dp=8, tp=8, pp=1, ep=16), dict(global_batch=4608, micro_batch=1)),
    "gpt_moe": _builtin("gpt_moe", _moe(2560, 32, 32, 10240, 5120, 16, 2, 0, 0, 50304, 2048),
                        dict(dp=8, tp=8, pp=1, ep=16, sharded_optimizer=True),
                        dict(global_batch=1024, micro_batch=1)),
    "kimi_moe": _builtin(
        "kimi_moe", _moe(2048, 32, 16, 11264, 1408, 176, 6, 1, 1, 163840, 8192),
        dict(dp=4, tp=4, pp=4, ep=16, sharded_optimizer=True),
        dict(global_batch=1024, micro_batch=1)),
    "deepseek_v2": _builtin(
        "deepseek_v2", _moe(5120, 60, 128, 12288, 1536, 160, 6, 4, 1, 102400, 4096),
        dict(dp=8, tp=8, pp=16, ep=16, sharded_optimizer=True),
        dict(global_batch=9216, micro_batch=1)),
    "deepseek_v3": _builtin(
        "deepseek_v3", _moe(7168, 61, 128, 18432, 2048, 256, 8, 1, 3, 129280, 4096, kv=64),
        dict(dp=128, tp=8, pp=16, ep=64, sharded_optimizer=True),
        dict(global_batch=15360, micro_batch=1)),
    "deepseek_v4": _builtin(
        "deepseek_v4", _moe(8192, 64, 128, 24576, 2048, 512, 8, 1, 3, 129280, 4096),
        dict(dp=1024, tp=8, pp=16, ep=64, sharded_optimizer=True),
        dict(global_batch=65536, micro_batch=1)),
}


def recipes_dir() -> Path:
    """``$LETO_RECIPES_DIR`` if set, else ``recipes/`` at the project root (beside ``src/``)."""
    env = os.environ.get("LETO_RECIPES_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "recipes"


def _recipe_file(name_or_path: str) -> Path | None:
    direct = Path(name_or_path).expanduser()
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        if not direct.is_file():
            fail("--recipe", name_or_path, "is not an existing file")
        return direct
    candidate = recipes_dir() / f"{name_or_path}.yaml"
    return candidate if candidate.is_file() else None


def _section(cfg: object, size: str, part: str) -> dict:
    from omegaconf import OmegaConf  # imported lazily: only YAML loading needs it

    node = OmegaConf.select(cfg, f"{size}.{part}")  # type: ignore[arg-type]
    if node is None:
        return {}
    return dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]


def _from_yaml(path: Path, size: str, fallback: Workload | None) -> tuple[Workload, list[str]]:
    from omegaconf import OmegaConf

    notes: list[str] = []
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # a broken file must name itself
        fail("--recipe", str(path), f"could not be parsed: {exc}")
    name = str(cfg.get("name") or path.stem)  # type: ignore[union-attr]
    parts = {p: _section(cfg, size, p) for p in ("model", "parallelism", "data")}
    base = fallback if fallback and fallback.name == name else None
    if base is not None:
        defaults = {"model": vars(base.model), "parallelism": vars(base.parallel),
                    "data": vars(base.data)}
        for part, values in parts.items():
            missing = sorted(set(defaults[part]) - set(values))
            missing = [k for k in missing if k != "vpp"]  # vpp is the simulator's own field
            if missing:
                notes.append(f"{path.name}: {size}.{part} lacks {', '.join(missing)}; "
                             "using the built-in values")
            parts[part] = {**defaults[part], **values}
    model = {k: v for k, v in parts["model"].items() if k in _MODEL_KEYS}
    par = {k: v for k, v in parts["parallelism"].items()
           if k in ("dp", "tp", "pp", "ep", "sharded_optimizer", "vpp")}
    data = {k: v for k, v in parts["data"].items() if k in ("global_batch", "micro_batch")}
    try:
        wl = Workload(name, ModelSpec(**model), ParallelSpec(**par), DataSpec(**data),
                      source=str(path))
    except TypeError as exc:
        fail("--recipe", str(path), f"{size} form is incomplete: {exc}")
    return wl, notes


def check_against_design(workload: Workload, tolerance: float = 0.05) -> list[str]:
    """Warnings where the counted parameters are off docs/design.md section 5 by more than 5%."""
    if workload.name not in DESIGN_PARAMS:
        return []
    notes = []
    for label, want, got in zip(("total", "active"), DESIGN_PARAMS[workload.name],
                                (workload.params.total, workload.params.active)):
        err = got / (want * 1e9) - 1.0
        if abs(err) > tolerance:
            notes.append(f"{workload.name}: {label} parameters {got / 1e9:.2f}B are "
                         f"{err:+.1%} off docs/design.md's {want}B")
    return notes


def load_workload(name_or_path: str, size: str = "full") -> Workload:
    """A recipe by name (YAML if present, else built in) or by YAML path.

    Differences from docs/design.md's parameter table (> 5%) and fields filled from the built-in
    definition are reported with ``warnings.warn``.
    """
    require(size in ("full", "tiny"), "size", size, "must be 'full' or 'tiny'")
    key = str(name_or_path)
    path = _recipe_file(key)
    builtin = BUILTIN_WORKLOADS.get(key if path is None else path.stem)
    if path is None:
        if builtin is None:
            fail("--recipe", key, "is not a known recipe (known: "
                 f"{', '.join(sorted(BUILTIN_WORKLOADS))}) nor a YAML file")
        require(size == "full", "size", size, f"has no built-in form for {key!r}")
        workload, notes = builtin, []
    else:
        workload, notes = _from_yaml(path, size, builtin if size == "full" else None)
    if size == "full":
        notes += check_against_design(workload)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return workload


def with_parallelism(workload: Workload, n_gpus: int | None = None,
                     **degrees: int | None) -> Workload:
    """Override parallelism degrees and/or the GPU count.

    With only ``n_gpus``, DP is scaled to reach it and the global batch scales with DP (constant
    work per replica, weak scaling). Explicit degrees must multiply to ``n_gpus`` when both are
    given.
    """
    p = workload.parallel
    given = {k: v for k, v in degrees.items() if v is not None}
    for key, value in given.items():
        int_at_least(f"--{key}", value, 1)
    deg = {k: given.get(k, getattr(p, k)) for k in ("dp", "tp", "pp")}
    if n_gpus is not None:
        int_at_least("--gpus", n_gpus, 1)
        if "dp" not in given:
            per = deg["tp"] * deg["pp"]
            require(n_gpus % per == 0, "--gpus", n_gpus,
                    f"is not a multiple of tp*pp={deg['tp']}*{deg['pp']}={per}")
            given["dp"] = deg["dp"] = n_gpus // per
        product = deg["dp"] * deg["tp"] * deg["pp"]
        require(product == n_gpus, "--gpus", n_gpus,
                f"differs from dp*tp*pp={deg['dp']}*{deg['tp']}*{deg['pp']}={product}")
    new = replace(p, **given)
    batch = workload.data.global_batch * new.dp // p.dp if new.dp != p.dp else \
        workload.data.global_batch
    data = replace(workload.data, global_batch=max(batch, new.dp * workload.data.micro_batch))
    return replace(workload, parallel=new, data=data)
