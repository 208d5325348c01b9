"""Runtime settings: detection timeouts, failure budget, shadow level, classification rules."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from ..errors import ConfigurationError, SharedMemoryCapacityError
from .storage import STORAGE_MESSAGES, PlantedLinkError

SHADOW_LEVELS = (1, 2, 3)


@dataclass(frozen=True)
class ClassificationRule:
    """One row of the HOF table: the first rule whose fields all match decides.

    ``exit_code`` / ``signal`` match a process exit; ``exception`` is a substring of the
    exception the trainer reported, ``exception_type`` its type name; ``reason`` is what the
    event log says. ``stop``: no restart can help (e.g. the run dir's disk is full): the job
    stops with the reason.
    """

    hof: bool
    reason: str
    exit_code: int | None = None
    signal: int | None = None
    exception: str | None = None
    hang: bool | None = None
    stop: bool = False
    exception_type: str | None = None


def default_rules() -> tuple[ClassificationRule, ...]:
    """docs/design.md section 1: software failures and contained device errors are operable."""
    storage = tuple(ClassificationRule(False, f"storage error in the run dir ({text}): free space or fix the "
                                              "filesystem, then relaunch (resumes from the last checkpoint)",
                                       exception=text, stop=True) for text in STORAGE_MESSAGES)
    environment = (  # what every restart would meet again
        ClassificationRule(False, "/dev/shm cannot hold the retained state: enlarge or free it, then relaunch",
                           exception_type=SharedMemoryCapacityError.__name__, stop=True),
        ClassificationRule(False, "a link or another user's file in the run dir: remove it, then relaunch",
                           exception_type=PlantedLinkError.__name__, stop=True),
    )
    return storage + environment + (
        ClassificationRule(False, "device lost (Xid 79-class): needs a reset or a new node", exception="GPU is lost"),
        ClassificationRule(False, "uncontained ECC / remap failure (Xid 48/64/95): GPU reset",
                           exception="uncorrectable ECC error encountered"),
        ClassificationRule(True, "contained device error (Xid 13/31/94-class)", exception="CUDA error"),
        ClassificationRule(True, "hang: no heartbeat within the timeout", hang=True),
        ClassificationRule(True, "trainer killed", signal=signal.SIGKILL),
        ClassificationRule(True, "trainer crashed (segfault/abort/bus error)", signal=signal.SIGSEGV),
        ClassificationRule(True, "trainer crashed (segfault/abort/bus error)", signal=signal.SIGABRT),
        ClassificationRule(True, "trainer crashed (segfault/abort/bus error)", signal=signal.SIGBUS),
        ClassificationRule(True, "trainer raised an exception", exit_code=1),
    )


@dataclass(frozen=True)
class RuntimeConfig:
    """How the agent watches and recovers a job.

    heartbeat_timeout: seconds without progress from a trainer before it counts as hung.
    startup_timeout:   seconds a trainer may take before its first heartbeat.
    poll_interval:     how often the agent checks processes and heartbeats.
    max_failures / failure_window: more failures than this within the window stop the job.
    shadow_level:      3 = full pre-init, 2 = device runtime only, 1 = interpreter + imports.
    extra_rules:       classification rules tried before the defaults (e.g. an exit code
                       that means "device lost").
    unknown_is_hof:    what an exit no rule matches counts as.
    defer_shadow_restart: start the next shadow set only after the first iteration after a
                       recovery completed -- on hosts with few cores a new shadow's imports
                       otherwise slow exactly that iteration (measured: 0.75 s vs 0.44 s on 2 cores).
    node_timeout:      seconds without a beat from another node's agent before that node counts as
                       lost (its machine, memory and device gone: a spare takes over).
    """

    heartbeat_timeout: float = 60.0
    startup_timeout: float = 300.0
    poll_interval: float = 0.05
    max_failures: int = 20
    failure_window: float = 3600.0
    shadow_level: int = 3
    extra_rules: tuple[ClassificationRule, ...] = ()
    unknown_is_hof: bool = True
    shadows: bool = True
    warm_template: bool = True  # fork trainers from a process that imported the script's modules
    defer_shadow_restart: bool = True
    rules: tuple[ClassificationRule, ...] = field(default_factory=default_rules)
    node_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_timeout", "startup_timeout", "poll_interval", "failure_window", "node_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name}={getattr(self, name)} must be positive")
        if self.max_failures < 1:
            raise ConfigurationError(f"max_failures={self.max_failures} must be at least 1")
        if self.shadow_level not in SHADOW_LEVELS:
            raise ConfigurationError(f"shadow_level={self.shadow_level}: choose 1, 2 or 3 (L1/L2/L3)")

    @property
    def all_rules(self) -> tuple[ClassificationRule, ...]:
        return tuple(self.extra_rules) + tuple(self.rules)
