"""Figure analogs (paper Figs. 9, 10, 14, 15) and the tables, written to a folder.

    python -m leto_lightning.sim.plots --out docs/sim

writes ``fig9_interval.png``, ``fig10_hof.png``, ``fig14_scale.png``, ``fig15_dsv4_hof.png``,
``fig16_spares_hof.png`` (Leto with hot spare nodes, not a paper figure), ``tables.md`` and
``results.json``. Curves use the analytic ETTR with each system's knob tuned per point (Fig. 9
sweeps the interval instead); the tables add Monte Carlo columns.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

try:
    import matplotlib
except ModuleNotFoundError as exc:  # an extra: the simulator itself runs without matplotlib
    raise ModuleNotFoundError('the simulator\'s figures need matplotlib: pip install "leto-lightning[sim]"',
                              name=exc.name) from None

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from leto_lightning.sim import tables
from leto_lightning.sim.ettr import analytic_ettr
from leto_lightning.sim.failures import LLAMA3_GPU_MTTF_S, FailureModel
from leto_lightning.sim.hardware import get_hardware
from leto_lightning.sim.report import SimSettings, evaluate, make_context
from leto_lightning.sim.startup import StartupModel
from leto_lightning.sim.systems import SYSTEM_NAMES, SystemContext, get_system
from leto_lightning.sim.workload import load_workload, with_parallelism

COLORS = {"leto": "tab:red", "leto+spares": "tab:purple", "gemini+": "tab:blue",
          "gemini": "tab:cyan", "moevement": "tab:green", "checkpoint": "tab:gray"}
ANALYTIC = SimSettings(monte_carlo=False)


def _tuned_ettr(ctx: SystemContext, system: str, mttf_s: float, hof: float) -> float:
    r = evaluate(ctx, system, FailureModel(mttf_s, hof), settings=ANALYTIC)
    return r.analytic.ettr if r.analytic else float("nan")


def fig9_interval(out: Path, hardware: str = "a100") -> dict[str, object]:
    """ETTR against the checkpoint interval, Leto vs Gemini+ (OLMoE, Kimi-MoE)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    data: dict[str, object] = {}
    intervals = np.unique(np.round(np.geomspace(1, 1000, 120)).astype(int))
    for ax, name in zip(axes, ("olmoe", "kimi_moe")):
        ctx = make_context(load_workload(name), get_hardware(hardware),
                           iteration_s=tables.PAPER_ITERATION_S[name])
        for system in ("leto", "gemini+", "gemini"):
            sched = get_system(system).schedule(ctx, 1)
            curve = analytic_ettr(sched, 600.0, 1.0, intervals)
            best = int(intervals[np.argmax(curve)])
            ax.plot(intervals, 100 * curve, color=COLORS[system], label=f"{system} (best I={best})")
            ax.plot([best], [100 * curve.max()], "o", color=COLORS[system])
            data[f"{name}/{system}"] = {"best_interval": best, "best_ettr": float(curve.max())}
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval (iterations)")
        ax.set_ylabel("ETTR (%)")
        ax.set_ylim(40, 100)
        ax.set_title(f"{name}: one HOF every 10 min ({hardware})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    _save(fig, out / "fig9_interval.png")
    return data


def fig10_hof(out: Path, hardware: str = "a100") -> dict[str, object]:
    """ETTR against the HOF share of failures (OLMoE, MTTF 10 min), knobs tuned per point."""
    ctx = make_context(load_workload("olmoe"), get_hardware(hardware),
                       iteration_s=tables.PAPER_ITERATION_S["olmoe"])
    shares = np.linspace(0.0, 1.0, 11)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    data: dict[str, object] = {}
    for system in SYSTEM_NAMES:
        ys = [_tuned_ettr(ctx, system, 600.0, float(h)) for h in shares]
        ax.plot(100 * shares, [100 * y for y in ys], "o-", ms=3, color=COLORS[system],
                label=system)
        data[system] = dict(zip([f"{h:.1f}" for h in shares], ys))
    ax.set_xlabel("HOF share of failures (%)")
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"olmoe, MTTF 10 min ({hardware}), tuned knobs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "fig10_hof.png")
    return data


SCALES = tuple(2 ** k for k in range(10, 18))   # 1,024 ... 131,072 GPUs


def _scale_series(name: str, comm: str, mttf_of: Callable[[int], float],
                  hardware: str) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {"leto": [], "gemini+": []}
    for n in SCALES:
        wl = with_parallelism(load_workload(name), n_gpus=n)
        ctx = make_context(wl, get_hardware(hardware), startup=StartupModel(comm_init=comm))
        for system in series:
            series[system].append(_tuned_ettr(ctx, system, mttf_of(n), 1.0))
    return series


def fig14_scale(out: Path, hardware: str = "a100") -> dict[str, object]:
    """ETTR against cluster size (DP scaled, global batch with it) for DeepSeek-V2/V3/V4."""
    panels = (("stock NCCL init, MTTF 10 min", "stock", lambda n: 600.0),
              ("scalable init, MTTF 10 min", "scalable", lambda n: 600.0),
              ("scalable init, Llama 3 per-GPU rate", "scalable",
               lambda n: LLAMA3_GPU_MTTF_S / n))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    data: dict[str, object] = {}
    styles = {"deepseek_v2": ":", "deepseek_v3": "--", "deepseek_v4": "-"}
    for ax, (title, comm, mttf_of) in zip(axes, panels):
        for name, style in styles.items():
            series = _scale_series(name, comm, mttf_of, hardware)
            for system, ys in series.items():
                ax.plot(SCALES, [100 * y for y in ys], style, marker="o", ms=3,
                        color=COLORS[system], label=f"{system} {name}")
            data[f"{title}/{name}"] = {k: dict(zip(map(str, SCALES), v)) for k, v in series.items()}
        ax.axhline(95, color="k", lw=0.7, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(f"{title} (HOF 100%, {hardware})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ETTR (%)")
    axes[0].legend(fontsize=7, ncol=2)
    _save(fig, out / "fig14_scale.png")
    return data


def fig15_dsv4_hof(out: Path, hardware: str = "a100") -> dict[str, object]:
    """DeepSeek-V4 on 131,072 GPUs: ETTR against HOF share at MTTF 10 min, 30 min, 1 h."""
    shares = np.linspace(0.0, 1.0, 11)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    data: dict[str, object] = {}
    wl = load_workload("deepseek_v4")
    for ax, comm in zip(axes, ("stock", "scalable")):
        ctx = make_context(wl, get_hardware(hardware), startup=StartupModel(comm_init=comm))
        for mttf, style in ((600.0, "-"), (1800.0, "--"), (3600.0, ":")):
            for system in ("leto", "gemini+"):
                ys = [_tuned_ettr(ctx, system, mttf, float(h)) for h in shares]
                ax.plot(100 * shares, [100 * y for y in ys], style, color=COLORS[system],
                        label=f"{system}, MTTF {mttf / 60:.0f} min")
                data[f"{comm}/{system}/{mttf:.0f}"] = dict(zip([f"{h:.1f}" for h in shares], ys))
        ax.axhline(95, color="k", lw=0.7, alpha=0.5)
        ax.set_xlabel("HOF share of failures (%)")
        ax.set_title(f"deepseek_v4, 131,072 GPUs, {comm} comm init ({hardware})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ETTR (%)")
    axes[0].legend(fontsize=7)
    _save(fig, out / "fig15_dsv4_hof.png")
    return data


SPARES_SYSTEMS = ("leto", "leto+spares", "gemini+", "checkpoint")


def fig16_spares_hof(out: Path, hardware: str = "a100") -> dict[str, object]:
    """DeepSeek-V4 on 131,072 GPUs, MTTF 10 min: ETTR against the HOF share for Leto, Leto with
    hot spare nodes (default pool: 2% of the nodes, 24 h repair), Gemini+ and checkpoint-restart."""
    shares = np.linspace(0.0, 1.0, 11)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    data: dict[str, object] = {}
    wl = load_workload("deepseek_v4")
    for ax, comm in zip(axes, ("stock", "scalable")):
        ctx = make_context(wl, get_hardware(hardware), startup=StartupModel(comm_init=comm))
        for system in SPARES_SYSTEMS:
            ys = [_tuned_ettr(ctx, system, 600.0, float(h)) for h in shares]
            ax.plot(100 * shares, [100 * y for y in ys], "o-", ms=3, color=COLORS[system],
                    label=system)
            data[f"{comm}/{system}"] = dict(zip([f"{h:.1f}" for h in shares], ys))
        ax.axhline(95, color="k", lw=0.7, alpha=0.5)
        ax.set_xlabel("HOF share of failures (%)")
        ax.set_title(f"deepseek_v4, 131,072 GPUs, MTTF 10 min, {comm} comm init ({hardware})",
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ETTR (%)")
    axes[1].legend(fontsize=8, loc="lower right")
    _save(fig, out / "fig16_spares_hof.png")
    return data


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tables(out: Path) -> None:
    """All markdown tables in one file."""
    sections = [
        ("Table 3 analog: Kimi-MoE, 64 A100s, one HOF every 10 minutes (iteration 9.097 s, "
         "the paper's measurement)", tables.table3_analog()),
        ("Table 4 analog: tuned interval I and MoEvement window W at MTTF 10 min / 30 min / 1 h "
         "(HOF 100%, the paper's measured iteration times)", tables.table4_analog()),
        ("Table 6 analog: iteration time, predicted vs measured", tables.iteration_validation_table()),
        ("ETTR validation: predicted vs the paper's fault-injection results (Table 3)",
         tables.ettr_validation_table()),
        ("DeepSeek-V4, 131,072 GPUs, MTTF 10 min (analytic; ✓ = Leto ≥ 95%)",
         tables.dsv4_headline_table()),
        ("Same, with tier-2 parity rebuild for non-HOFs (--leto-tier2)",
         tables.dsv4_headline_table(tier2=True)),
        ("Hot spare nodes (leto+spares): DeepSeek-V4, 131,072 GPUs, MTTF 10 min, HOF 50%, "
         "scalable comm init (analytic)", tables.spares_sensitivity_table()),
        ("Same, stock NCCL init", tables.spares_sensitivity_table(comm="stock")),
    ]
    text = "# Simulator tables (generated by `python -m leto_lightning.sim.plots`)\n"
    for title, table in sections:
        text += f"\n## {title}\n\n{table}\n"
    (out / "tables.md").write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m leto_lightning.sim.plots",
                                     description="Write the simulator's figures and tables.")
    parser.add_argument("--out", default="docs/sim", help="output folder (default: docs/sim)")
    parser.add_argument("--hardware", default="a100", help="hardware profile (default: a100)")
    parser.add_argument("--no-tables", action="store_true", help="figures only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"fig9": fig9_interval(out, args.hardware), "fig10": fig10_hof(out, args.hardware),
               "fig14": fig14_scale(out, args.hardware),
               "fig15": fig15_dsv4_hof(out, args.hardware),
               "fig16": fig16_spares_hof(out, args.hardware),
               "dsv4_headline": tables.dsv4_headline(),
               "spares_sensitivity": tables.spares_sensitivity()}
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    if not args.no_tables:
        write_tables(out)
    print(f"wrote figures, tables.md and results.json to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
