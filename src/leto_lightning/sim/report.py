"""One simulation: a workload on a hardware profile under a failure model, for several systems.

``simulate`` builds the iteration time (or takes a measured one), each system's schedule at its
tuned (or given) knob, the analytic expectation and, optionally, the Monte Carlo runs, and
returns a ``SimulationReport`` that renders as a text table or as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from leto_lightning.sim.checks import int_at_least, positive, require
from leto_lightning.sim.ettr import AnalyticResult, MonteCarloResult, analytic, monte_carlo
from leto_lightning.sim.failures import FailureModel
from leto_lightning.sim.hardware import HardwareProfile
from leto_lightning.sim.iteration import (
    DEFAULT_OVERLAP,
    MemoryBreakdown,
    OverlapConfig,
    iteration_time,
    memory_per_gpu,
)
from leto_lightning.sim.startup import StartupModel
from leto_lightning.sim.systems import (
    SYSTEM_NAMES,
    Schedule,
    SystemContext,
    SystemKnobs,
    SystemModel,
    get_system,
    shadow_level,
)
from leto_lightning.sim.tuning import tune
from leto_lightning.sim.workload import Workload

DAY_S = 86400.0


@dataclass(frozen=True)
class SimSettings:
    """Monte Carlo settings."""

    horizon_s: float = 30 * DAY_S
    runs: int = 8
    seed: int = 0
    monte_carlo: bool = True

    def __post_init__(self) -> None:
        positive("horizon", self.horizon_s)
        int_at_least("runs", self.runs, 1)
        int_at_least("seed", self.seed, 0)


@dataclass(frozen=True)
class SystemResult:
    """One system's tuned (or fixed) knob, expectation and simulation."""

    system: str
    reason: str = ""                          # why the system does not support the workload
    knob: str = ""
    param: int = 0
    tuned: bool = False
    young: float | None = None
    schedule: Schedule | None = None
    analytic: AnalyticResult | None = None
    mc: MonteCarloResult | None = None

    @property
    def supported(self) -> bool:
        return not self.reason

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"system": self.system, "supported": self.supported}
        if not self.supported:
            out["reason"] = self.reason
            return out
        assert self.schedule is not None and self.analytic is not None
        out.update(knob=self.knob, param=self.param, tuned=self.tuned, young=self.young,
                   schedule=schedule_dict(self.schedule), analytic=self.analytic.as_dict(),
                   monte_carlo=self.mc.as_dict() if self.mc else None)
        return out


def schedule_dict(s: Schedule) -> dict[str, object]:
    """JSON-friendly view of a schedule."""
    modes = [{"kind": kind, "probability": p, **asdict(m), "duration_s": m.duration_s}
             for kind, table in (("hof", s.hof_modes), ("non-hof", s.nonhof_modes))
             for p, m in table if p > 0]
    return {"interval": s.interval, "iteration_s": s.iteration_s, "reference_s": s.reference_s,
            "checkpoint_s": s.checkpoint_s, "shadow_rebuild_s": s.shadow_rebuild_s,
            "modes": modes, **({"spares": s.spares.as_dict()} if s.spares else {})}


@dataclass(frozen=True)
class SimulationReport:
    """Everything one ``leto simulate`` run computed."""

    context: SystemContext
    iteration_source: str          # "model" or "measured"
    memory: MemoryBreakdown
    failures: FailureModel
    settings: SimSettings
    results: tuple[SystemResult, ...]

    @property
    def workload(self) -> Workload:
        return self.context.workload

    def result(self, system: str) -> SystemResult:
        key = get_system(system).name
        for r in self.results:
            if r.system == key:
                return r
        raise KeyError(system)

    def as_dict(self) -> dict[str, object]:
        wl, ctx = self.workload, self.context
        return {
            "workload": {"name": wl.name, "source": wl.source, "n_gpus": wl.n_gpus,
                         "total_params": wl.params.total, "active_params": wl.params.active,
                         "model": asdict(wl.model), "parallelism": asdict(wl.parallel),
                         "data": asdict(wl.data)},
            "hardware": asdict(ctx.hardware),
            "iteration": {"source": self.iteration_source, "seconds": ctx.iteration_s,
                          "model": ctx.breakdown.as_dict()},
            "memory_gb": self.memory.as_dict(),
            "shadow_level": shadow_level(ctx),
            "failures": {"mttf_s": self.failures.mttf_s, "hof_ratio": self.failures.hof_ratio,
                         "trace": self.failures.trace.source if self.failures.trace else None},
            "settings": asdict(self.settings),
            "startup": ctx.startup.as_dict(), "knobs": asdict(ctx.knobs),
            "systems": [r.as_dict() for r in self.results],
        }


def make_context(workload: Workload, hardware: HardwareProfile, *,
                 startup: StartupModel | None = None, knobs: SystemKnobs | None = None,
                 overlap: OverlapConfig = DEFAULT_OVERLAP,
                 iteration_s: float | None = None) -> SystemContext:
    """Iteration model + cost-model settings for ``workload`` on ``hardware``."""
    breakdown = iteration_time(workload, hardware, overlap)
    if iteration_s is not None:
        positive("--iteration-time", iteration_s)
    return SystemContext(workload, hardware, breakdown,
                         iteration_s if iteration_s is not None else breakdown.total_s,
                         startup or StartupModel(), knobs or SystemKnobs())


def evaluate(ctx: SystemContext, system: str, failures: FailureModel,
             param: int | None = None, settings: SimSettings = SimSettings()) -> SystemResult:
    """Tune (unless ``param`` is given) and evaluate one system; of the configurations it
    offers (``SystemModel.contexts``) the best analytic ETTR wins."""
    model = get_system(system)
    reason = model.supported(ctx)
    if reason:
        return SystemResult(model.name, reason=reason)
    ctx = replace(ctx, failures=failures)
    candidates = [_expectation(model, c, failures, param) for c in model.contexts(ctx)]
    best = max(candidates, key=lambda r: r.analytic.ettr if r.analytic else -1.0)
    if settings.monte_carlo and best.schedule is not None:
        best = replace(best, mc=monte_carlo(best.schedule, failures, settings.horizon_s,
                                            settings.runs, settings.seed))
    return best


def _expectation(model: SystemModel, ctx: SystemContext, failures: FailureModel,
                 param: int | None) -> SystemResult:
    """One configuration: its knob (tuned unless given), schedule and analytic ETTR."""
    young, tuned = None, param is None
    if param is None:
        best = tune(model, ctx, failures.mttf_s, failures.hof_ratio)
        param, young = best.param, best.young
    schedule = model.schedule(ctx, param)
    expected = analytic(schedule, failures.mttf_s, failures.hof_ratio)
    return SystemResult(model.name, knob=model.knob, param=param, tuned=tuned, young=young,
                        schedule=schedule, analytic=expected)


def simulate(workload: Workload, hardware: HardwareProfile, failures: FailureModel,
             systems: Sequence[str] = SYSTEM_NAMES, params: Mapping[str, int] | None = None,
             settings: SimSettings = SimSettings(), *, startup: StartupModel | None = None,
             knobs: SystemKnobs | None = None, overlap: OverlapConfig = DEFAULT_OVERLAP,
             iteration_s: float | None = None) -> SimulationReport:
    """Evaluate ``systems`` on one workload; ``params`` fixes a system's knob (else tuned)."""
    require(len(systems) > 0, "--systems", list(systems), "must name at least one system")
    names = [get_system(s).name for s in systems]
    fixed = {get_system(k).name: v for k, v in (params or {}).items()}
    ctx = make_context(workload, hardware, startup=startup, knobs=knobs, overlap=overlap,
                       iteration_s=iteration_s)
    results = tuple(evaluate(ctx, n, failures, fixed.get(n), settings) for n in names)
    return SimulationReport(ctx, "measured" if iteration_s is not None else "model",
                            memory_per_gpu(workload), failures, settings, results)


def _fmt_duration(seconds: float) -> str:
    if seconds >= 2 * DAY_S:
        return f"{seconds / DAY_S:.3g} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"


def summary_lines(report: SimulationReport) -> list[str]:
    """Header lines: workload, iteration time, memory, failures."""
    ctx, b = report.context, report.context.breakdown
    f = report.failures
    parts = ", ".join(f"{k[:-2]} {v:.3g}" for k, v in b.as_dict().items()
                      if k != "total_s" and v > 0)
    lines = [f"workload   {report.workload.describe()}",
             f"hardware   {ctx.hardware.name} ({ctx.hardware.peak_tflops:g} TFLOP/s, "
             f"{ctx.hardware.hbm_gb:g} GB)",
             f"iteration  {ctx.iteration_s:.3f} s ({report.iteration_source}; model "
             f"{b.total_s:.3f} s = {parts})",
             f"memory     {report.memory.total_gb:.1f} GB per GPU of {ctx.hardware.hbm_gb:g} GB; "
             f"Leto shadow level L{shadow_level(ctx)}",
             f"failures   MTTF {_fmt_duration(f.mttf_s)}, HOF ratio {f.hof_ratio:.2f}"
             + (f", trace {f.trace.source}" if f.trace else "")]
    if report.memory.total_gb > ctx.hardware.hbm_gb:
        lines.append(f"warning    training needs {report.memory.total_gb:.1f} GB per GPU, more "
                     f"than the {ctx.hardware.hbm_gb:g} GB of {ctx.hardware.name}")
    if report.settings.monte_carlo:
        s = report.settings
        lines.append(f"monte carlo {s.runs} runs x {_fmt_duration(s.horizon_s)}, seed {s.seed}")
    for r in report.results:
        if r.schedule is not None and r.schedule.spares is not None:
            lines += [f"{'spares' if k == 0 else '':<10} {text}"
                      for k, text in enumerate(r.schedule.spares.describe())]
    return lines


TABLE_HEADERS = ("system", "knob", "ckpt s", "init s", "recompute s", "recovery s",
                 "ETTR (analytic)", "ETTR (monte carlo)")


def table_rows(report: SimulationReport) -> list[tuple[str, ...]]:
    """One row per system, strings, in ``TABLE_HEADERS`` order."""
    rows: list[tuple[str, ...]] = []
    cap = report.context.knobs.max_interval
    for r in report.results:
        if not r.supported:
            rows.append((r.system, "unsupported", "", "", "", "", r.reason, ""))
            continue
        assert r.analytic is not None and r.schedule is not None
        a = r.analytic
        knob = f"{'I' if r.knob == 'interval' else 'W'}={r.param}" + (" (tuned)" if r.tuned else "")
        if r.tuned and r.knob == "interval" and r.param == cap:
            knob = f"I={r.param} (tuned, cap)"
        mc = f"{r.mc.ettr:.2%} ± {r.mc.stderr:.2%}" if r.mc else "-"
        rows.append((r.system, knob, f"{r.schedule.checkpoint_s:.2f}", f"{a.init_s:.1f}",
                     f"{a.recompute_s:.1f}", f"{a.recovery_s:.1f}", f"{a.ettr:.2%}", mc))
    return rows


def format_report(report: SimulationReport) -> str:
    """Plain-text rendering (the CLI uses rich when it can)."""
    rows = [TABLE_HEADERS] + table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADERS))]
    lines = summary_lines(report) + [""]
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
