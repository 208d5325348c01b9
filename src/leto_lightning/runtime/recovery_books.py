"""The books of one in-place recovery: its timing breakdown and what the event log reports.

``RecoveryTiming`` is filled in as the recovery goes (``recovery_flow.py`` lists what each
interval measures); ``RecoveryBooks`` is what stays open from the moment every rank resumed
until every rank finished its first iteration after resuming, when ``recovery_finished`` is
logged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum


class Resumption(StrEnum):
    """What the recovered job resumed with (the events' ``promoted`` field)."""

    SHADOW = "shadow"  # the shadow set was promoted
    COLD = "cold"  # new trainers started and attached to the retained state


@dataclass
class RecoveryTiming:
    detect: float = 0.0
    stop: float = 0.0
    attach_repair: float = 0.0
    transfer: float = 0.0  # a lost node's state moved to its spare (its source and the spare; 0 elsewhere)
    start: float = 0.0
    init: float = 0.0
    resume: float = 0.0

    def rounded(self) -> dict[str, float]:
        """The breakdown as logged (``recompute`` / ``next_iteration`` are added once known)."""
        return {k: round(v, 4) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class RecoveryBooks:
    timing: RecoveryTiming
    t_fail: float  # when the failure happened (the breakdown's time line starts here)
    resume_iteration: int | None
    failed_iteration: int | None
    recomputes: bool  # the failed iteration is redone (it failed before its update committed)
    promoted: Resumption
    shadow_level: int  # what the job recovered from (0: a cold start)
    t_resumed: float  # when the last rank resumed
    repair: list[str] = field(default_factory=list)  # each store's repair summary
