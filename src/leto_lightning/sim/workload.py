"""Workloads: model architecture, parallelism and batch, and their parameter counts.

A workload comes from ``recipes/<name>.yaml`` (only ``<size>.model``, ``<size>.parallelism`` and
``<size>.data`` are read, with omegaconf) or from the built-in definitions below, which carry the
same numbers as the recipes' ``full`` forms so the simulator works without the YAML files.
Those three sections are the recipe schema of ``leto_lightning.recipes`` (one schema with the
trainer: the same YAML gives the same model here and in ``leto train``), with its parameter
counting convention; the simulator adds only virtual pipeline stages (``ParallelSpec.vpp``)
and the workload as a whole (``Workload``: a name, its source, the checks across sections).

Parallelism: GPUs = dp * tp * pp; ep splits the routed experts inside the dp*tp ranks of one
pipeline stage (Megatron "MoE parallel folding", expert tensor parallelism 1).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path

from leto_lightning.recipes import (
    DataConfig,
    ModelConfig,
    ParallelismConfig,
    ParamCounts,
    parameter_counts,
    recipes_dir,
)
from leto_lightning.sim.checks import fail, int_at_least, require

__all__ = ["BUILTIN_WORKLOADS", "DESIGN_PARAMS", "DataSpec", "ModelSpec", "ParallelSpec", "ParamCounts", "Workload",
           "check_against_design", "count_parameters", "load_workload", "recipes_dir", "with_parallelism"]

ModelSpec = ModelConfig  # the recipes' ``model:`` section, one schema with the trainer's
DataSpec = DataConfig  # the recipes' ``data:`` section: sequences per iteration and per micro-batch
count_parameters = parameter_counts  # by part (``ParamCounts``); ``total``/``active`` as the recipes count
_MODEL_KEYS = tuple(f.name for f in fields(ModelConfig))
# Without these a YAML form that is not a built-in's describes no workload (the schema's defaults
# are a tiny model): refused as incomplete rather than simulated.
_REQUIRED = {"model": ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "seq_len"),
             "parallelism": ("dp",), "data": ("global_batch",)}


@dataclass(frozen=True)
class ParallelSpec(ParallelismConfig):
    """The recipes' ``parallelism:`` section plus the simulator's own virtual pipeline stages."""

    vpp: int = 1   # interleaved (virtual) pipeline stages per rank; 1 = plain 1F1B

    def __post_init__(self) -> None:
        super().__post_init__()
        int_at_least("parallelism.vpp", self.vpp, 1)

    @property
    def n_gpus(self) -> int:
        return self.world_size

    @property
    def edp(self) -> int:
        """Data-parallel degree of the expert weights (replicas of one expert shard)."""
        return self.dp * self.tp // self.ep


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
    name = str(OmegaConf.select(cfg, "name") or path.stem)
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
    else:
        for part, keys in _REQUIRED.items():
            missing = [k for k in keys if k not in parts[part]]
            if missing:
                fail("--recipe", str(path), f"{size} form is incomplete: {size}.{part} lacks {', '.join(missing)}")
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
    notes: list[str]
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
    new = replace(p, **given)  # type: ignore[arg-type]  # every degree is an int, none the bool field
    batch = workload.data.global_batch * new.dp // p.dp if new.dp != p.dp else \
        workload.data.global_batch
    data = replace(workload.data, global_batch=max(batch, new.dp * workload.data.micro_batch))
    return replace(workload, parallel=new, data=data)
