"""``leto simulate``: ETTR of Leto and its baselines for a recipe, cluster and failure model.

Examples::

    leto simulate --recipe kimi_moe --mttf 10m
    leto simulate --recipe deepseek_v4 --hardware h200 --comm-init scalable --hof-ratio 0.5
    leto simulate --recipe deepseek_v3 --gpus 65536 --gpu-mttf llama3 --json
    leto simulate --recipe kimi_moe --iteration-time 9.097 --interval gemini=11 --interval leto=32
    leto simulate --trace failures.csv --systems leto,gemini+
    leto simulate --recipe deepseek_v4 --comm-init scalable --hof-ratio 0.5 \
        --systems leto,leto+spares,gemini+,checkpoint --spares 2% --spare-repair 24h
    leto simulate --validate
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from leto_lightning.sim.checks import fail, int_at_least, require
from leto_lightning.sim.failures import LLAMA3_GPU_MTTF_S, FailureModel, load_trace, parse_duration
from leto_lightning.sim.hardware import BUILTIN_HARDWARE, get_hardware, parse_overrides
from leto_lightning.sim.report import DAY_S, SimSettings, SimulationReport, format_report, simulate
from leto_lightning.sim.spares import DEFAULT_JOIN_S, TIER3_MODES, SpareConfig, parse_spares
from leto_lightning.sim.startup import COMM_INIT_MODES, StartupModel
from leto_lightning.sim.systems import SYSTEM_NAMES, SystemKnobs, get_system
from leto_lightning.sim.workload import BUILTIN_WORKLOADS, load_workload, with_parallelism

_EPILOG = """\
durations take a unit: s, m/min, h, d (a bare number is minutes for --mttf, hours for
--gpu-mttf). --gpu-mttf llama3 uses Llama 3's rate (419 failures in 54 days on 16,384 GPUs).
Systems: leto, gemini+, gemini, moevement, checkpoint (the default set) and leto+spares (Leto
with a pool of hot spare nodes for non-HOFs: --spares, --spare-repair, --spare-join, --tier3).
Knobs are tuned for ETTR unless fixed with --interval SYSTEM=N (the checkpoint interval, or
MoEvement's window W). Model and defaults: docs/simulator.md.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``leto simulate``."""
    p = subparsers.add_parser(
        "simulate", help="simulate ETTR of Leto and its baselines (up to 131,072 GPUs)",
        description="Predict iteration time, per-failure recovery cost and ETTR (analytic "
                    "expectation and Monte Carlo) of Leto, Gemini, Gemini+, MoEvement and "
                    "checkpoint-restart, each with its checkpoint interval tuned for ETTR.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--recipe", default="kimi_moe", metavar="NAME|PATH",
                   help=f"recipe name ({', '.join(BUILTIN_WORKLOADS)}) or YAML file "
                        "(default: kimi_moe)")
    w.add_argument("--size", default="full", choices=("full", "tiny"),
                   help="recipe form (default: full)")
    w.add_argument("--gpus", type=_gpu_count, help="GPU count; DP (and the global batch) scale to it")
    for key in ("dp", "tp", "pp", "ep"):
        w.add_argument(f"--{key}", type=int, help=f"override the recipe's {key.upper()} degree")
    w.add_argument("--iteration-time", type=float, metavar="SECONDS",
                   help="use a measured iteration time instead of the model")
    h = p.add_argument_group("hardware")
    h.add_argument("--hardware", default="a100", choices=sorted(BUILTIN_HARDWARE),
                   help="hardware profile (default: a100)")
    h.add_argument("--hw", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a profile field, e.g. --hw net_gbps=50 (repeatable)")
    f = p.add_argument_group("failures")
    src = f.add_mutually_exclusive_group()
    src.add_argument("--mttf", default="10m", help="job mean time to failure (default: 10m)")
    src.add_argument("--gpu-mttf", metavar="DURATION|llama3",
                     help="per-GPU MTTF; the job MTTF is it divided by the GPU count")
    src.add_argument("--trace", metavar="CSV", help="failure trace (time,kind per line)")
    f.add_argument("--hof-ratio", type=float, default=1.0,
                   help="share of failures that are hardware-operable (default: 1.0; with "
                        "--trace the trace's kinds decide)")
    _add_model_args(p)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("systems and cost model")
    s.add_argument("--systems", default=",".join(SYSTEM_NAMES),
                   help=f"comma-separated systems (default: {','.join(SYSTEM_NAMES)})")
    s.add_argument("--interval", action="append", default=[], metavar="SYSTEM=N",
                   help="fix a system's knob instead of tuning it (repeatable)")
    s.add_argument("--comm-init", default="stock", choices=COMM_INIT_MODES,
                   help="communicator initialization at scale: stock NCCL (~265 s at 96K GPUs) "
                        "or scalable (NCCLX-class, 11x faster) (default: stock)")
    s.add_argument("--leto-fallback", type=float, default=0.0, metavar="SHARE",
                   help="share of HOFs whose in-place recovery falls back to the checkpoint")
    s.add_argument("--leto-tier2", action="store_true",
                   help="non-HOFs rebuild the lost device's state from tier-2 parity "
                        "(no rollback) instead of restarting from the checkpoint")
    s.add_argument("--spares", default="2%", metavar="N|P%",
                   help="leto+spares: hot spare nodes, a count or a share of the job's nodes "
                        "rounded up (default: 2%%)")
    s.add_argument("--spare-repair", default="24h", metavar="DURATION",
                   help="leto+spares: time until a used spare's node is back in the pool "
                        "(default: 24h; a bare number is hours)")
    s.add_argument("--spare-join", type=float, default=DEFAULT_JOIN_S, metavar="SECONDS",
                   help="leto+spares: the spare's ranks join the promoted shadows' "
                        f"communicators (default: {DEFAULT_JOIN_S:g})")
    s.add_argument("--tier3", default="auto", choices=TIER3_MODES,
                   help="leto+spares: cross-node erasure code for state without a replica; auto "
                        "keeps it where it raises ETTR (default: auto)")
    r = p.add_argument_group("simulation and output")
    r.add_argument("--days", type=float, help="simulated time per run (default: 30, or the "
                                              "trace's span)")
    r.add_argument("--runs", type=int, default=8, help="Monte Carlo runs (default: 8)")
    r.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    r.add_argument("--no-monte-carlo", action="store_true", help="analytic expectation only")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.add_argument("--validate", nargs="?", const="", metavar="MEASURED_JSON",
                   help="print predicted vs measured iteration time and ETTR (default file: "
                        "docs/sim/measured.json, plus measured_tiny.json beside it) and exit")
    p.set_defaults(func=run)


MAX_GPUS = 1 << 20  # beyond the largest clusters the cost model was fitted for (131,072 GPUs) by 8x
MAX_FAILURES_PER_RUN = 50_000  # a Monte Carlo run's work grows with this (~0.2 ms CPU per failure): bound it


def _gpu_count(text: str) -> int:
    """``--gpus``: an integer in [1, MAX_GPUS] (``1e5``-style numbers accepted when whole)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs") from None
    if value != value or not 1 <= value <= MAX_GPUS or value != int(value):
        raise argparse.ArgumentTypeError(f"--gpus={text} must be a whole number in [1, {MAX_GPUS:,}]")
    return int(value)


def _check_work(failures: FailureModel, days: float) -> None:
    """Refuse a failure rate whose simulation would run for hours (or print NaN) instead of
    answering: one failure per few seconds of a month is no training at all."""
    expected = days * DAY_S / failures.mttf_s
    require(expected <= MAX_FAILURES_PER_RUN, "job MTTF", f"{failures.mttf_s:g} s",
            f"means {expected:,.0f} failures in {days:g} days, more than the simulator's bound of "
            f"{MAX_FAILURES_PER_RUN:,} per run: raise --mttf/--gpu-mttf or lower --days")


def _failures(args: argparse.Namespace, n_gpus: int) -> tuple[FailureModel, float | None]:
    """Failure model and the default horizon it implies (a trace's span)."""
    from leto_lightning.sim.checks import fraction

    fraction("--hof-ratio", args.hof_ratio)
    if args.trace:
        trace = load_trace(args.trace)
        return FailureModel.from_trace(trace), trace.span_s
    if args.gpu_mttf:
        gpu = LLAMA3_GPU_MTTF_S if args.gpu_mttf.lower() == "llama3" else \
            parse_duration(args.gpu_mttf, "--gpu-mttf", default_unit="h")
        return FailureModel.per_gpu(gpu, n_gpus, args.hof_ratio), None
    return FailureModel(parse_duration(args.mttf, "--mttf"), args.hof_ratio), None


def _intervals(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        require(bool(sep), "--interval", item, "must look like SYSTEM=N")
        try:
            number = int(value)
        except ValueError:
            fail("--interval", item, "needs an integer N")
        int_at_least(f"--interval {name}", number, 1)
        out[get_system(name).name] = number
    return out


def _spares(args: argparse.Namespace) -> SpareConfig:
    nodes, share = parse_spares(args.spares)
    return SpareConfig(nodes=nodes, share=share, join_s=args.spare_join, tier3=args.tier3,
                       repair_s=parse_duration(args.spare_repair, "--spare-repair", default_unit="h"))


def _report(args: argparse.Namespace) -> SimulationReport:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workload = load_workload(args.recipe, args.size)
    for w in caught:
        print(f"leto simulate: warning: {w.message}", file=sys.stderr)
    if args.gpus is not None or any(getattr(args, k) is not None for k in ("dp", "tp", "pp", "ep")):
        workload = with_parallelism(workload, args.gpus, dp=args.dp, tp=args.tp, pp=args.pp,
                                    ep=args.ep)
    hardware = get_hardware(args.hardware, parse_overrides(args.hw))
    failures, span = _failures(args, workload.n_gpus)
    days = args.days if args.days is not None else (span / DAY_S if span else 30.0)
    require(days > 0, "--days", days, "must be > 0")
    if failures.trace is None:
        _check_work(failures, days)
    settings = SimSettings(days * DAY_S, args.runs, args.seed, not args.no_monte_carlo)
    knobs = SystemKnobs(leto_fallback=args.leto_fallback, leto_tier2=args.leto_tier2,
                        spares=_spares(args))
    systems = [s for s in args.systems.split(",") if s.strip()]
    return simulate(workload, hardware, failures, systems, _intervals(args.interval), settings,
                    startup=StartupModel(comm_init=args.comm_init), knobs=knobs,
                    iteration_s=args.iteration_time)


def _validate(args: argparse.Namespace) -> int:
    from leto_lightning.sim.tables import ettr_validation_table, iteration_validation_table

    path = args.validate or None
    if args.json:
        from leto_lightning.sim.validation import ettr_rows, iteration_rows

        print(json.dumps({"iteration_time": [r.as_dict() for r in iteration_rows(path)],
                          "ettr": [r.as_dict() for r in ettr_rows(path)]}, indent=2))
    else:
        print(iteration_validation_table(path))
        print()
        print(ettr_validation_table(path))
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``leto simulate``; bad input exits 2 with the offending value named."""
    try:
        if args.validate is not None:
            return _validate(args)
        report = _report(args)
    except ValueError as exc:
        print(f"leto simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m leto_lightning.sim.cli``: the same as ``leto simulate``."""
    parser = argparse.ArgumentParser(prog="leto")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
