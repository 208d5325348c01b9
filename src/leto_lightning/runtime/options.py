"""Runtime options of a protected trainer and what the environment says about this process.

Why a separate dataclass: ``RetainedConfig`` describes *memory* (pages, parity) and belongs to
the layers below; these options describe how *this trainer* takes part in a Leto job (which
job, resume or start fresh, shadow pre-init level, heartbeats). Both are validated when the
trainer is built (``LetoStrategy``, ``LetoConfig``), so a typo fails at construction, not
minutes into a run. Why here, in ``runtime/``: they are neutral to the trainer library; the
Lightning and the Accelerate integrations both use them.

Environment (set by ``leto launch``; the names are ``leto_lightning/env.py``'s):

- ``LETO_JOB_ID``: the job whose retained segments this rank creates or attaches to;
- ``LETO_RESUME``: ``"retained"`` = attach to the retained store and continue from it;
- ``LETO_SHADOW_LEVEL``: 1, 2 or 3 (L1/L2/L3 pre-initialisation of a shadow).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..env import JOB_ID, RESUME, ResumeMode
from ..errors import ConfigurationError

_JOB_ID = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class LetoRuntimeOptions:
    """How this trainer takes part in a Leto job.

    job_id:            retained-memory namespace (segments ``leto-<job_id>-...``); None: from
                       ``LETO_JOB_ID``, else a fresh random id (a single-process job).
    resume:            None (start fresh unless ``LETO_RESUME=retained`` or
                       Lightning's ``ckpt_path="leto://retained"``) or ``"retained"``.
    shadow_level:      1, 2 or 3 -- how far a shadow of this trainer pre-initialises.
    heartbeat_interval: seconds between progress reports to the agent.
    heartbeat_timeout: seconds without a heartbeat before the agent declares a hang; must
                       leave room for several intervals.
    """

    job_id: str | None = None
    resume: str | None = None
    shadow_level: int = 3
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.job_id is not None and not _JOB_ID.match(self.job_id):
            raise ConfigurationError(f"job_id={self.job_id!r}: use letters, digits and '_' only (it names "
                                     "shared-memory segments)")
        if self.resume not in (None, ResumeMode.RETAINED):
            raise ConfigurationError(f"resume={self.resume!r}: choose None (start fresh) or "
                                     f"{ResumeMode.RETAINED.value!r}")
        if self.shadow_level not in (1, 2, 3):
            raise ConfigurationError(f"shadow_level={self.shadow_level!r}: choose 1, 2 or 3 (L1 imports only, L2 "
                                     "device runtime, L3 full pre-initialisation)")
        if not self.heartbeat_interval > 0:
            raise ConfigurationError(f"heartbeat_interval={self.heartbeat_interval!r} must be positive")
        if not self.heartbeat_timeout >= 3 * self.heartbeat_interval:
            raise ConfigurationError(f"heartbeat_timeout={self.heartbeat_timeout!r} must be at least 3 heartbeat "
                                     f"intervals ({3 * self.heartbeat_interval} s): one late heartbeat must not count "
                                     "as a hang")

    @staticmethod
    def parse_level(level: int | str) -> int:
        """Accept 3, "3" or "L3"."""
        text = str(level).upper().removeprefix("L")
        if not text.isdigit():
            raise ConfigurationError(f"shadow_level={level!r}: choose 1, 2 or 3 (or 'L1', 'L2', 'L3')")
        return int(text)

    def resolved_job_id(self, env: Mapping[str, str] = os.environ) -> str | None:
        """Strategy argument first, then the launcher's ``LETO_JOB_ID``."""
        job = self.job_id or env.get(JOB_ID) or None
        if job is not None and not _JOB_ID.match(job):
            raise ConfigurationError(f"{JOB_ID}={job!r}: use letters, digits and '_' only")
        return job

    def resume_requested(self, env: Mapping[str, str] = os.environ) -> bool:
        """True when this process must continue from retained memory (argument or environment)."""
        return self.resume == ResumeMode.RETAINED or env.get(RESUME, "") == ResumeMode.RETAINED
