"""Per-system fault-tolerance cost models: what each system pays in the fault-free path and what
each failure costs it.

A ``Schedule`` is everything the ETTR model needs for one system at one setting of its tuning
knob (checkpoint interval I, or MoEvement's sparse window W): the iteration time with the
system's overhead, the checkpoint stall, and per failure kind (HOF / non-HOF) the recovery modes
with their probabilities, durations and rollback targets.

Systems (``docs/design.md`` section 2.7; the Leto paper's Tables 3/4, docs/sim/measured.json):

- ``checkpoint``: checkpoint-restart. Snapshots go to persistent storage; a failure restarts every
  process cold, reloads from storage and recomputes since the checkpoint.
- ``gemini``: in-memory checkpoints in host memory (Wang et al., SOSP 2023); cold restart,
  reload from host memory, recompute since the checkpoint, plus warm-up iterations.
- ``gemini+``: Gemini with a pre-warmed spare process: the restart skips launch, imports, CUDA
  context and model build, and the warm-up.
- ``moevement``: sparse in-memory checkpoints of MoE experts (Gandhi & Kozyrakis, NSDI 2026):
  1/W of the state per iteration; a failure restarts and replays the sparse window (MoE only).
- ``leto``: HOFs recover in place (detect, stop, promote the pre-initialized shadows, repair,
  recompute the interrupted iteration); non-HOFs (and HOFs whose in-place recovery falls back)
  take the spare-based path: a Gemini+-style restart from the in-memory checkpoint, or with
  ``leto_tier2`` a rebuild of the lost device's state from tier-2 parity with no rollback.
- ``leto+spares``: Leto with a pool of hot spare nodes (``spares.py``): a non-HOF that finds a
  spare moves the lost node's ranks to it, which receives their state from replicas (or
  rebuilds it from tier-3 parity) while the other nodes recover in place as after a HOF; no
  rollback. A non-HOF that finds the pool empty takes Leto's path. Not in the default list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from leto_lightning.errors import UsageError
from leto_lightning.sim.checks import fail, fraction, int_at_least, non_negative, require
from leto_lightning.sim.failures import FailureModel
from leto_lightning.sim.hardware import HardwareProfile
from leto_lightning.sim.iteration import IterationBreakdown, checkpoint_bytes_per_gpu, memory_per_gpu
from leto_lightning.sim.spares import SpareConfig, SparePlan, plan, tier3_choices
from leto_lightning.sim.startup import StartupModel
from leto_lightning.sim.workload import Workload

ROLLBACKS = ("iteration", "checkpoint")
SYSTEM_NAMES = ("leto", "gemini+", "gemini", "moevement", "checkpoint")   # the default set
SYSTEM_ALIASES = {"leto-spares": "leto+spares", "letospares": "leto+spares",
                  "gemini-plus": "gemini+", "geminiplus": "gemini+", "cr": "checkpoint",
                  "checkpoint-restart": "checkpoint", "ckpt": "checkpoint"}
# Shadow pre-init memory (assumption): L3 holds a CUDA context (~0.5 GB) and the shadows' own
# communicator buffers (~2.5 GB; NCCLX reports 10+ GB when many communicators coexist), L2 only
# the context.
SHADOW_L3_GB = 3.0
SHADOW_L2_GB = 0.5


@dataclass(frozen=True)
class RecoveryMode:
    """One way of recovering from a failure."""

    name: str
    init_s: float            # restart / promotion time
    load_s: float = 0.0      # checkpoint load or state rebuild
    replay_s: float = 0.0    # warm-up or replayed iterations (reported as recompute)
    rollback: str = "checkpoint"   # progress kept: "iteration" start or last "checkpoint"
    uses_shadow: bool = False      # needs the L3 shadow pool (rebuilt after each promotion)

    def __post_init__(self) -> None:
        for key in ("init_s", "load_s", "replay_s"):
            non_negative(f"{self.name}.{key}", getattr(self, key))
        require(self.rollback in ROLLBACKS, f"{self.name}.rollback", self.rollback,
                f"must be one of {ROLLBACKS}")

    @property
    def duration_s(self) -> float:
        return self.init_s + self.load_s + self.replay_s


Modes = tuple[tuple[float, RecoveryMode], ...]


def _check_modes(name: str, modes: Modes) -> None:
    require(len(modes) > 0, name, modes, "needs at least one recovery mode")
    for prob, _ in modes:
        fraction(f"{name} probability", prob)
    total = sum(p for p, _ in modes)
    require(abs(total - 1.0) < 1e-9, name, total, "probabilities must sum to 1")


@dataclass(frozen=True)
class Schedule:
    """One system at one knob setting, as the ETTR model sees it."""

    system: str
    param: int               # the tuned knob: checkpoint interval I, or MoEvement window W
    interval: int            # iterations between checkpoints (1 with no checkpoints)
    iteration_s: float       # iteration time including the system's per-iteration overhead
    reference_s: float       # fault-free iteration time without any fault tolerance
    checkpoint_s: float      # stall per checkpoint
    hof_modes: Modes
    nonhof_modes: Modes
    shadow_rebuild_s: float = 0.0
    spares: SparePlan | None = None   # leto+spares: the pool; when usable, ``nonhof_modes`` is
    #                                   (spare found, pool empty) and the Monte Carlo replays it

    def __post_init__(self) -> None:
        int_at_least("interval", self.interval, 1)
        int_at_least("param", self.param, 1)
        require(self.iteration_s >= self.reference_s > 0, "iteration_s", self.iteration_s,
                f"must be >= reference_s={self.reference_s} > 0")
        non_negative("checkpoint_s", self.checkpoint_s)
        non_negative("shadow_rebuild_s", self.shadow_rebuild_s)
        _check_modes("hof_modes", self.hof_modes)
        _check_modes("nonhof_modes", self.nonhof_modes)
        if self.spares is not None and self.spares.usable:
            require(len(self.nonhof_modes) == 2, "nonhof_modes", len(self.nonhof_modes),
                    "must be (spare found, pool empty) with a spare pool")


@dataclass(frozen=True)
class SystemKnobs:
    """Modelling choices that are not hardware or workload."""

    leto_fallback: float = 0.0       # share of HOFs whose in-place recovery falls back to the
    #                                  checkpoint (damage beyond parity, failed promotion):
    #                                  unknown, the paper reports none; 0 by default
    leto_tier2: bool = False         # non-HOFs rebuilt from tier-2 parity instead of rollback
    leto_overhead_ratio: float = (111 - 47) / 47   # Table 1: RMU update 111 ms vs plain 47 ms
    moevement_max_window: int = 8    # Table 4 never tunes W above 8
    moevement_replay_factor: float = 1.5   # calibrated to Table 4 (see docs/simulator.md)
    moevement_hidden: float = 0.6    # share of the sparse snapshot hidden behind compute
    #                                  (calibrated to Table 4 with the replay factor)
    max_interval: int = 10_000       # largest checkpoint interval the tuner considers
    spares: SpareConfig = field(default_factory=SpareConfig)   # leto+spares' pool and tier 3

    def __post_init__(self) -> None:
        fraction("leto_fallback", self.leto_fallback)
        non_negative("leto_overhead_ratio", self.leto_overhead_ratio)
        int_at_least("moevement_max_window", self.moevement_max_window, 1)
        non_negative("moevement_replay_factor", self.moevement_replay_factor)
        fraction("moevement_hidden", self.moevement_hidden)
        int_at_least("max_interval", self.max_interval, 1)


@dataclass(frozen=True)
class SystemContext:
    """Everything a cost model reads."""

    workload: Workload
    hardware: HardwareProfile
    breakdown: IterationBreakdown
    iteration_s: float                 # reference iteration time (modelled or measured)
    startup: StartupModel = field(default_factory=StartupModel)
    knobs: SystemKnobs = field(default_factory=SystemKnobs)
    failures: FailureModel | None = None   # set by the evaluator; read by leto+spares' pool

    @property
    def n_gpus(self) -> int:
        return self.workload.n_gpus

    @property
    def ckpt_bytes(self) -> float:
        return checkpoint_bytes_per_gpu(self.workload)

    @property
    def snapshot_s(self) -> float:
        """Stall of one in-memory (host) checkpoint."""
        return self.ckpt_bytes / (self.hardware.ckpt_gbps * 1e9)

    @property
    def host_load_s(self) -> float:
        return self.ckpt_bytes / (self.hardware.pcie_gbps * 1e9)

    @property
    def storage_gbps_per_gpu(self) -> float:
        return min(self.hardware.ckpt_gbps, self.hardware.storage_gbps / self.n_gpus)


def shadow_level(ctx: SystemContext) -> int:
    """Pre-init level the shadow keeps with the training memory in use (docs/design.md 2.4)."""
    free = ctx.hardware.hbm_gb - memory_per_gpu(ctx.workload).total_gb
    return 3 if free >= SHADOW_L3_GB else 2 if free >= SHADOW_L2_GB else 1


def _same(mode: RecoveryMode) -> Modes:
    return ((1.0, mode),)


def _schedule(ctx: SystemContext, name: str, param: int, **kw: object) -> Schedule:
    kw.setdefault("interval", param)
    kw.setdefault("iteration_s", ctx.iteration_s)
    return Schedule(system=name, param=param, reference_s=ctx.iteration_s, **kw)  # type: ignore[arg-type]


def _gemini(ctx: SystemContext, interval: int) -> Schedule:
    s = ctx.startup
    mode = RecoveryMode("restart", s.restart_init_s(ctx.n_gpus, prewarmed=False),
                        ctx.host_load_s, s.cold_warmup_iters * ctx.iteration_s)
    return _schedule(ctx, "gemini", interval, checkpoint_s=ctx.snapshot_s,
                     hof_modes=_same(mode), nonhof_modes=_same(mode))


def _gemini_plus(ctx: SystemContext, interval: int) -> Schedule:
    mode = RecoveryMode("spare restart", ctx.startup.restart_init_s(ctx.n_gpus, prewarmed=True),
                        ctx.host_load_s)
    return _schedule(ctx, "gemini+", interval, checkpoint_s=ctx.snapshot_s,
                     hof_modes=_same(mode), nonhof_modes=_same(mode))


def _checkpoint_restart(ctx: SystemContext, interval: int) -> Schedule:
    s, bw = ctx.startup, ctx.storage_gbps_per_gpu * 1e9
    mode = RecoveryMode("restart from storage", s.restart_init_s(ctx.n_gpus, prewarmed=False),
                        ctx.ckpt_bytes / bw, s.cold_warmup_iters * ctx.iteration_s)
    return _schedule(ctx, "checkpoint", interval, checkpoint_s=ctx.ckpt_bytes / bw,
                     hof_modes=_same(mode), nonhof_modes=_same(mode))


def _moevement(ctx: SystemContext, window: int) -> Schedule:
    k, s = ctx.knobs, ctx.startup
    snapshot = ctx.snapshot_s * (1 - k.moevement_hidden) / window
    replay = (k.moevement_replay_factor * window + s.cold_warmup_iters) * ctx.iteration_s
    mode = RecoveryMode("restart + sparse replay", s.restart_init_s(ctx.n_gpus, prewarmed=False),
                        ctx.host_load_s, replay, rollback="iteration")
    return _schedule(ctx, "moevement", window, interval=1, checkpoint_s=0.0,
                     iteration_s=ctx.iteration_s + snapshot,
                     hof_modes=_same(mode), nonhof_modes=_same(mode))


def leto_inplace_mode(ctx: SystemContext) -> RecoveryMode:
    """In-place recovery; a shadow demoted by memory pressure must redo what it gave up."""
    s, n = ctx.startup, ctx.n_gpus
    init = s.leto_inplace_s(n, ctx.hardware.gpus_per_node)
    level = shadow_level(ctx)
    if level <= 2:     # communicators among the shadows were given up
        init += s.comm_init_s(n) + s.rendezvous_s(n)
    if level == 1:     # and the device runtime too
        init += s.cuda_context_s
    return RecoveryMode(f"in-place (L{level} shadow)", init, rollback="iteration",
                        uses_shadow=level == 3)


def _leto(ctx: SystemContext, interval: int) -> Schedule:
    k, s = ctx.knobs, ctx.startup
    inplace = leto_inplace_mode(ctx)
    spare = RecoveryMode("spare + checkpoint", s.restart_init_s(ctx.n_gpus, prewarmed=True),
                         ctx.host_load_s)
    hof: Modes = ((1.0 - k.leto_fallback, inplace), (k.leto_fallback, spare))
    nonhof = spare
    if k.leto_tier2:
        rebuild = ctx.ckpt_bytes / (ctx.hardware.net_gbps * ctx.hardware.comm_efficiency * 1e9)
        nonhof = RecoveryMode("spare + tier-2 rebuild", spare.init_s, rebuild,
                              rollback="iteration")
    overhead = ctx.breakdown.optimizer_s * k.leto_overhead_ratio
    rebuild_s = s.shadow_rebuild_s(ctx.n_gpus) if inplace.uses_shadow else 0.0
    return _schedule(ctx, "leto", interval, checkpoint_s=ctx.snapshot_s,
                     iteration_s=ctx.iteration_s + overhead, hof_modes=hof,
                     nonhof_modes=_same(nonhof), shadow_rebuild_s=rebuild_s)


def _leto_spares(ctx: SystemContext, interval: int) -> Schedule:
    """Leto, and a non-HOF that finds a hot spare recovers like a HOF plus the spare's join and
    state transfer, keeping progress; a non-HOF that finds the pool empty takes Leto's path."""
    if ctx.failures is None:
        raise UsageError("leto+spares needs the failure rate to size its spare pool: evaluate it "
                         "with report.evaluate, or set SystemContext.failures")
    base = _leto(ctx, interval)
    f = ctx.failures
    pool = plan(ctx.knobs.spares, ctx.workload, ctx.hardware, f.rate_per_s * (1 - f.hof_ratio))
    if not pool.usable:
        return replace(base, system="leto+spares", spares=pool)
    inplace, fallback = leto_inplace_mode(ctx), base.nonhof_modes[0][1]
    what = "tier-3 rebuild" if pool.tier3 else "replica copy"
    spare = RecoveryMode(f"hot spare + {what}", inplace.init_s + pool.join_s, pool.transfer_s,
                         rollback="iteration", uses_shadow=inplace.uses_shadow)
    empty = replace(fallback, name=f"{fallback.name} (pool empty)")
    return replace(base, system="leto+spares", iteration_s=base.iteration_s + pool.encode_s,
                   nonhof_modes=((1.0 - pool.blocking, spare), (pool.blocking, empty)),
                   spares=pool)


def _spare_contexts(ctx: SystemContext) -> tuple[SystemContext, ...]:
    """leto+spares with tier 3 off and on (``--tier3 auto`` where some state has no replica)."""
    cfg = ctx.knobs.spares
    return tuple(replace(ctx, knobs=replace(ctx.knobs, spares=replace(cfg, tier3="on" if on else "off")))
                 for on in tier3_choices(cfg, ctx.workload, ctx.hardware))


@dataclass(frozen=True)
class SystemModel:
    """A named system: which knob it tunes and how to build its schedule."""

    name: str
    knob: str                                          # "interval" or "window"
    build: Callable[[SystemContext, int], Schedule]
    moe_only: bool = False
    variants: Callable[[SystemContext], tuple[SystemContext, ...]] | None = None

    def supported(self, ctx: SystemContext) -> str | None:
        """None if the system supports the workload, else why not."""
        if self.moe_only and not ctx.workload.model.n_experts:
            return ("checkpoints experts sparsely; a dense model is not supported "
                    "(paper Table 4: '-')")
        return None

    def contexts(self, ctx: SystemContext) -> tuple[SystemContext, ...]:
        """Configurations the evaluator compares, the best ETTR winning (the first on a tie):
        one, unless the system has a choice to make (leto+spares: tier 3 off or on)."""
        return self.variants(ctx) if self.variants else (ctx,)

    def max_param(self, ctx: SystemContext) -> int:
        return ctx.knobs.moevement_max_window if self.knob == "window" else ctx.knobs.max_interval

    def schedule(self, ctx: SystemContext, param: int) -> Schedule:
        int_at_least(self.knob, param, 1)
        return self.build(ctx, param)


SYSTEMS: dict[str, SystemModel] = {
    "leto": SystemModel("leto", "interval", _leto),
    "leto+spares": SystemModel("leto+spares", "interval", _leto_spares, variants=_spare_contexts),
    "gemini+": SystemModel("gemini+", "interval", _gemini_plus),
    "gemini": SystemModel("gemini", "interval", _gemini),
    "moevement": SystemModel("moevement", "window", _moevement, moe_only=True),
    "checkpoint": SystemModel("checkpoint", "interval", _checkpoint_restart),
}


def get_system(name: str) -> SystemModel:
    key = SYSTEM_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in SYSTEMS:
        fail("--systems", name, f"is not a known system (known: {', '.join(SYSTEMS)})")
    return SYSTEMS[key]
