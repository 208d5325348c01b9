"""Shadow memory reclaim: a pre-warmed shadow never makes the active trainers run out of memory.

The policy is a small state machine over the shadow's level (``ShadowLevel``, owned by
``ReclaimPolicy``). It reads one ``MemorySample`` per sample interval and compares the tightest
free figure (host or any GPU) with two watermarks::

    free < low                          -> demote one level   L3 -> L2 -> L1 -> NONE
    free > high for promote_after_s     -> promote one level  NONE -> L1 -> L2 -> L3 (never above
                                           the launch's --shadow-level, and only when the footprint
                                           last measured at the higher level still leaves > high)
    low <= free <= high                 -> stay (the band between the watermarks is the hysteresis)

and never changes twice within ``dwell_s``. NONE means the job runs without a shadow: a failure
is then recovered by a cold start (new trainers attach to the retained state). A level change
replaces the shadow set with one started at the new level (``ShadowReclaimer``): simple, and the
memory the old shadows held is returned to the system when they exit.
"""

from __future__ import annotations

import argparse
import enum
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from ..console import notice
from ..errors import ConfigurationError
from .config import RuntimeConfig
from .control import SignedStore
from .coordination import JobIdentity
from .event_types import MemoryOverBudget, ShadowLevelChanged
from .events import EventLog
from .keys import SHADOWS_READY
from .memory import MemoryBudget, MemoryProbe, MemorySample, parse_size
from .spec import LaunchSpec
from .trainers import Trainers

log = logging.getLogger(__name__)


class ShadowLevel(enum.IntEnum):
    NONE = 0  # no shadow: cold start on failure
    L1 = 1  # interpreter and imports
    L2 = 2  # + device runtime
    L3 = 3  # fully pre-initialised (model, optimizer, retained state attached)


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def watermark(text: str, what: str) -> float | int:
    """``"10%"`` -> 0.10 (of the limit), ``"256MiB"`` -> bytes."""
    m = _PERCENT.match(str(text))
    if m is None:
        return parse_size(text, what)
    fraction = float(m.group(1)) / 100
    if not 0 < fraction < 1:
        raise ConfigurationError(f"{what} {text!r}: a percentage of the limit must be between 0% and 100%, e.g. 10%")
    return fraction


@dataclass(frozen=True)
class ReclaimConfig:
    """How the agent watches memory. ``enabled`` False: the probe still reports a job over its
    budget (event ``memory_over_budget``), but no shadow changes level.

    low / high:       free-memory watermarks: a fraction of the limit (0 < f < 1) or bytes
    dwell_s:          the least time between two level changes (no flapping)
    promote_after_s:  how long free memory must stay above ``high`` before a promotion
    sample_interval:  seconds between two samples (each: one /proc read per process)
    """

    enabled: bool = True
    budget: MemoryBudget = field(default_factory=MemoryBudget)
    low: float | int = 0.10
    high: float | int = 0.25
    dwell_s: float = 2.0
    promote_after_s: float = 30.0
    sample_interval: float = 0.25

    def __post_init__(self) -> None:
        for name in ("dwell_s", "promote_after_s", "sample_interval"):
            if getattr(self, name) < 0 or (name == "sample_interval" and self.sample_interval == 0):
                raise ConfigurationError(f"memory reclaim {name}={getattr(self, name)} must be positive")
        for name in ("low", "high"):
            value = getattr(self, name)
            if (isinstance(value, float) and not 0 < value < 1) or (isinstance(value, int) and value <= 0):
                raise ConfigurationError(f"memory reclaim {name}={value!r}: a fraction in (0, 1) or a positive size")
        if type(self.low) is type(self.high) and self.low >= self.high:
            raise ConfigurationError(f"memory reclaim watermarks low={self.low} >= high={self.high}: the low "
                                     "watermark (demote below it) must be under the high one (promote above it)")

    def bytes_of(self, mark: float, limit: int) -> int:
        return int(mark * limit) if isinstance(mark, float) else int(mark)


@dataclass(frozen=True)
class LevelChange:
    old: ShadowLevel
    new: ShadowLevel
    reason: str


class ReclaimPolicy:
    """The state machine of the module docstring; ``decide`` is fed samples, returns a change or None."""

    def __init__(self, config: ReclaimConfig, start: ShadowLevel, now: float) -> None:
        self.config = config
        self.level = start
        self.ceiling = start  # the launch's --shadow-level: never promoted above it
        self._changed_at = now
        self._free_since: float | None = None
        self.footprint: dict[ShadowLevel, int] = {}  # bytes a ready shadow set held at each level

    @classmethod
    def for_launch(cls, config: ReclaimConfig, runtime: RuntimeConfig) -> ReclaimPolicy:
        """Starting at the launch's --shadow-level (NONE with --no-shadows), now."""
        return cls(config, ShadowLevel(runtime.shadow_level if runtime.shadows else 0), time.time())

    def observe_shadow(self, level: ShadowLevel, nbytes: int) -> None:
        """What a ready shadow set at ``level`` holds (used to check that a promotion would fit)."""
        self.footprint[level] = nbytes

    def decide(self, sample: MemorySample, now: float) -> LevelChange | None:
        c = self.config
        free = sample.tightest_free
        low, high = c.bytes_of(c.low, sample.limit), c.bytes_of(c.high, sample.limit)
        if free >= low:
            self._free_since = (self._free_since or now) if free > high else None
        settled = now - self._changed_at >= c.dwell_s
        if free < low and self.level > ShadowLevel.NONE and settled:
            why = f"free {free >> 20} MiB < low watermark {low >> 20} MiB"
            return self._change(ShadowLevel(self.level - 1), why, now)
        if self._free_since is None or self.level >= self.ceiling or not settled:
            return None
        if now - self._free_since < c.promote_after_s:
            return None
        up = ShadowLevel(self.level + 1)
        extra = self.footprint.get(up, 0) - self.footprint.get(self.level, 0)
        if free - extra <= high:  # the higher level would push free memory back under the band
            return None
        return self._change(up, f"free {free >> 20} MiB > high watermark {high >> 20} MiB for "
                                f"{now - self._free_since:.1f} s", now)

    def _change(self, new: ShadowLevel, reason: str, now: float) -> LevelChange:
        change = LevelChange(self.level, new, reason)
        self.level, self._changed_at, self._free_since = new, now, None
        return change


def check_supported(spec: LaunchSpec) -> None:
    """The memory policy runs for single-node ``leto launch`` jobs only (refused before anything starts)."""
    if spec.nnodes > 1 or spec.trainer_layout is not None:
        raise ConfigurationError("--memory-budget / memory reclaim: only single-node `leto launch` jobs so far "
                                 f"(this one has --nnodes {spec.nnodes}); drop the option for multi-node jobs")


class ShadowReclaimer:
    """The agent's side: samples in the watch loop, replaces the shadow set on a level change,
    records every change (``shadow_level_changed``) and a job over its budget (``memory_over_budget``).
    ``busy()``: a recovery owns the shadow set now (nothing changes then)."""

    def __init__(self, config: ReclaimConfig, policy: ReclaimPolicy, trainers: Trainers, job: JobIdentity,
                 store: SignedStore, events: EventLog, out: TextIO, busy: Callable[[], bool]) -> None:
        self.config, self.policy = config, policy
        self.trainers, self.job, self.store, self.events, self.out = trainers, job, store, events, out
        self._busy = busy
        self.probe = MemoryProbe(config.budget, trainers.running_pids, lambda: job.all_job_ids)
        self._next_sample = 0.0
        self._over = False
        self.last: MemorySample | None = None

    @property
    def level(self) -> ShadowLevel:
        return self.policy.level

    def figures(self, sample: MemorySample) -> dict:
        t = self.trainers
        return sample.figures({"active": [p.pid for p in t.actives.values()],
                               "shadow": [p.pid for p in t.shadows.values()]})

    def poll(self) -> None:
        """Called once per watch-loop pass; samples at most every ``sample_interval``."""
        now = time.time()
        if now < self._next_sample:
            return
        self._next_sample = now + self.config.sample_interval
        t = self.trainers
        sample = self.last = self.probe.sample()
        self._report_budget(sample)
        if not self.config.enabled or self._busy():
            return  # a recovery in progress owns the shadow set
        if t.shadows and (self.store.read(SHADOWS_READY) or b"").decode() == t.shadow_set:
            self.policy.observe_shadow(self.level, sum(sample.processes.get(p.pid, 0) for p in t.shadows.values()))
        change = self.policy.decide(sample, now)
        if change is not None:
            self._apply(change, sample)

    def _report_budget(self, sample: MemorySample) -> None:
        over = sample.tightest_free < 0
        if over and not self._over:
            self.events.write(MemoryOverBudget(generation=self.job.generation, level=int(self.level),
                                               reclaim=self.config.enabled, **self.figures(sample)))
            log.warning("job over its memory budget: %s", self.figures(sample))
            notice(f"warning: memory over the limit ({sample.source}): {sample.used >> 20} MiB used of "
                   f"{sample.limit >> 20} MiB", self.out)
        self._over = over

    def _apply(self, change: LevelChange, sample: MemorySample) -> None:
        t = self.trainers
        figures = self.figures(sample)  # with the shadows that are replaced
        count = t.claim_replacement()  # our own replacement: watch_shadows must not redo it
        t.stop_shadows()
        self.store.set(SHADOWS_READY, "")
        self.events.write(ShadowLevelChanged(generation=self.job.generation, old=int(change.old),
                                             new=int(change.new), reason=change.reason, **figures))
        if change.new == ShadowLevel.NONE:
            notice(f"memory: running WITHOUT a shadow ({change.reason}): a failure now means a cold start", self.out)
            return
        notice(f"memory: shadow level L{int(change.old)} -> L{int(change.new)} ({change.reason})", self.out)
        t.start_shadows(replacement=count)

    def close(self) -> None:
        self.probe.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``leto launch``'s memory options (docs/reclaim.md)."""
    g = parser.add_argument_group(
        "shadow memory reclaim",
        "Watch memory and move the shadows down a level (L3 -> L2 -> L1 -> none) when it runs short, back up "
        "when it has been free long enough (docs/reclaim.md). Single-node jobs.")
    g.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="the job's memory on this node (its trainers, shadows and retained memory), e.g. 2GiB; "
                        "turns the policy on (default: no budget, the policy off)")
    g.add_argument("--device-memory-budget", default=None, metavar="SIZE",
                   help="the job's memory per GPU (NVML figures of its processes), e.g. 40GiB")
    g.add_argument("--memory-reclaim", choices=("auto", "on", "off"), default="auto",
                   help="auto: on when a budget is given; on: also against cgroup v2 / /proc/meminfo / NVML; "
                        "off: only report a job over its budget (event memory_over_budget)")
    g.add_argument("--reclaim-low", default="10%", metavar="FREE",
                   help="demote when free memory falls under this (%% of the limit or a size; default 10%%)")
    g.add_argument("--reclaim-high", default="25%", metavar="FREE",
                   help="promote when free memory stayed above this for --reclaim-promote-after (default 25%%)")
    g.add_argument("--reclaim-dwell", type=float, default=2.0, metavar="S", help="least seconds between changes")
    g.add_argument("--reclaim-promote-after", type=float, default=30.0, metavar="S",
                   help="seconds free memory must stay above --reclaim-high before a promotion")


def config_from_args(args: argparse.Namespace) -> ReclaimConfig | None:
    """None: no probe at all (no budget and --memory-reclaim auto/off): the agent as before."""
    budget = MemoryBudget(
        parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None,
        parse_size(args.device_memory_budget, "--device-memory-budget") if args.device_memory_budget else None)
    has_budget = budget.node_bytes is not None or budget.device_bytes is not None
    if not has_budget and args.memory_reclaim != "on":
        return None
    return ReclaimConfig(enabled=args.memory_reclaim != "off", budget=budget,
                         low=watermark(args.reclaim_low, "--reclaim-low"),
                         high=watermark(args.reclaim_high, "--reclaim-high"),
                         dwell_s=args.reclaim_dwell, promote_after_s=args.reclaim_promote_after)
