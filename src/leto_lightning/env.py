"""The process environment of leto-lightning: every ``LETO_*`` variable, and the one place that reads them.

The launcher-to-worker contract -- every ``LETO_*`` variable an agent gives its trainers -- and the
knobs users and tests set.

Why one module: the agent (``runtime/agent.py``) writes these variables and the trainer's
side (the session, the Lightning and Accelerate integrations, the examples) reads them, in
separate processes. Spelled as string literals in each of them, a renamed variable or a new
role fails silently in the other process. Here each variable has one name, one writer
(``WorkerContract.to_env``) and one reader (``WorkerContract.from_env``, which validates and
names the variable and the value it rejects).

What the contract holds (``leto launch`` sets all of them for every trainer)::

    LETO_ROLE           Role: "active" or "shadow"
    LETO_JOB_ID         retained-memory namespace (segments ``leto-<job_id>-...``)
    LETO_RUN_DIR        the job's run directory (events, outputs)
    LETO_NODE_RANK      the node of this trainer (also torchrun's GROUP_RANK)
    LETO_GENERATION     Leto's restart count (a new one per recovery)
    LETO_SHADOW_SET     "<generation>-<replacement>" of the shadows started, "" before any
    LETO_SHADOW_LEVEL   0-3: how far a shadow pre-initialises (0: no shadows run)
    LETO_RESUME         ResumeMode: "" (fresh), "retained", "checkpoint"
    LETO_FAULTS         injected faults (tests, benchmarks, demos): a JSON list of objects
    LETO_EVENTS         the agent's event log (the trainer reports rejected messages to it)
    LETO_STORE_PREFIX   key prefix in a launcher's shared store (per-rank supervision), "" none
    LETO_AUTH_KEY       the job's secret, hex (signs control messages; environment only)

torchrun's own variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) keep torchrun's
meaning and are written by ``runtime/worker_env.py``.

The knobs a *user* (or a test) sets, which no launcher writes, are named below as constants
too (``DEBUG``, ``SECRET``, ...), so that no module spells a ``LETO_`` name as a literal.
``LETO_<FIELD>`` overrides of ``LetoConfig`` fields are formed by ``field_override``.

Who reads the environment: the top level, ``integrations/`` and ``runtime/`` (with the readers
at the end of this module). The layers below them -- ``updater/``, ``retained/``,
``protection/`` -- never do: what a variable says reaches them as a parameter (the job-id
prefix; the fused Adam switch, the agent's CUDA state manager and the run directory a private
manager listens in, bundled as ``ProcessSettings``). One exception, ``isal_library``: ISA-L is
located once per process when ``protection/checksum.py`` is imported, before any caller could
pass a path (``tests/test_environment_reads.py`` names it and checks everything else).

A leaf module: it imports only the standard library and ``leto_lightning.errors``, so every
layer may use it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import ConfigurationError

# -- the contract's variables ---------------------------------------------------------------
ROLE = "LETO_ROLE"
JOB_ID = "LETO_JOB_ID"
RUN_DIR = "LETO_RUN_DIR"
NODE_RANK = "LETO_NODE_RANK"
GENERATION = "LETO_GENERATION"
SHADOW_SET = "LETO_SHADOW_SET"
SHADOW_LEVEL = "LETO_SHADOW_LEVEL"
RESUME = "LETO_RESUME"
FAULTS = "LETO_FAULTS"
EVENTS = "LETO_EVENTS"
STORE_PREFIX = "LETO_STORE_PREFIX"
AUTH_KEY = "LETO_AUTH_KEY"
CUDA_MANAGER = "LETO_CUDA_MANAGER"  # address of the CUDA state manager new CUDA stores allocate from
CONTRACT_VARIABLES = (ROLE, JOB_ID, RUN_DIR, NODE_RANK, GENERATION, SHADOW_SET, SHADOW_LEVEL, RESUME, FAULTS,
                      EVENTS, STORE_PREFIX, AUTH_KEY, CUDA_MANAGER)

# -- knobs users and tests set (not written by a launcher) ----------------------------------
DEBUG = "LETO_DEBUG"  # `leto` CLI: show tracebacks of expected errors too
SECRET = "LETO_SECRET"  # the job's secret (multi-node), at least 16 characters
SECRET_FILE = "LETO_SECRET_FILE"  # ... or a file holding it, readable by its owner only
ALLOW_UNTESTED_LIGHTNING = "LETO_ALLOW_UNTESTED_LIGHTNING"  # "1": run a Lightning outside the tested range
ALLOW_UNTESTED_ACCELERATE = "LETO_ALLOW_UNTESTED_ACCELERATE"  # "1": run an Accelerate outside the tested range
NO_SUPERVISE = "LETO_NO_SUPERVISE"  # "1": a rank under torchrun/Lightning does not become its own agent
WARM_TEMPLATE = "LETO_WARM_TEMPLATE"  # "0": every agent starts every trainer from a new interpreter
SHADOWS = "LETO_SHADOWS"  # "0": per-rank agents keep no shadows (a failure starts new trainers)
JOB_PREFIX = "LETO_JOB_PREFIX"  # prepended to new job ids (a test session's leak guard)
RECIPES_DIR = "LETO_RECIPES_DIR"  # where the recipe YAMLs are (default: recipes/ beside src/)
ISAL_LIBRARY = "LETO_ISAL_LIBRARY"  # path of an ISA-L shared library to use instead of pyeclib's
FUSED_ADAM = "LETO_FUSED_ADAM"  # "0": Adam chunks run torch's math, not the fused kernel (updater/fused_adam.py)
WANDB = "LETO_WANDB"  # examples: "0" turns the wandb logger off
FIELD_PREFIX = "LETO_"


def field_override(field_name: str) -> str:
    """The variable that overrides a config field: ``tier1_parity`` -> ``LETO_TIER1_PARITY``."""
    return FIELD_PREFIX + field_name.upper()


class Role(StrEnum):
    """What a trainer process is for. A promoted shadow keeps ``SHADOW`` in its environment;
    the session tells it apart by having been promoted."""

    ACTIVE = "active"
    SHADOW = "shadow"


class ResumeMode(StrEnum):
    """How an active trainer starts: ``FRESH`` (a new job), ``RETAINED`` (a cold restart that
    attaches to the retained state the recovery repaired), ``CHECKPOINT`` (after a failure that
    is not a HOF, or damage beyond parity: from the last checkpoint)."""

    FRESH = ""
    RETAINED = "retained"
    CHECKPOINT = "checkpoint"


SHADOW_LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True)
class WorkerContract:
    """What a launcher tells one trainer process (module doc for each variable)."""

    role: Role
    job_id: str
    run_dir: str = "."
    node_rank: int = 0
    generation: int = 0
    shadow_set: str = "0"
    shadow_level: int = 3
    resume: ResumeMode = ResumeMode.FRESH
    faults: tuple[Mapping[str, Any], ...] = ()
    events: str | None = None
    store_prefix: str = ""
    auth_key: str = field(default="", repr=False)  # a secret: never in a repr or a log line
    cuda_manager: str = ""  # the agent's CUDA state manager for this rank (runtime/state_managers.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", _enum(Role, ROLE, self.role))
        object.__setattr__(self, "resume", _enum(ResumeMode, RESUME, self.resume))
        object.__setattr__(self, "faults", tuple(self.faults))
        if not self.job_id:
            raise ConfigurationError(f"{JOB_ID}={self.job_id!r}: a trainer needs the job id its launcher chose")
        for name, value in ((NODE_RANK, self.node_rank), (GENERATION, self.generation)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(f"{name}={value!r}: expected an integer >= 0")
        if self.shadow_level not in SHADOW_LEVELS or isinstance(self.shadow_level, bool):
            raise ConfigurationError(f"{SHADOW_LEVEL}={self.shadow_level!r}: choose 0, 1, 2 or 3")
        for fault in self.faults:
            if not isinstance(fault, Mapping):
                raise ConfigurationError(f"{FAULTS}: every fault is a JSON object, got {fault!r}")

    @property
    def is_shadow(self) -> bool:
        return self.role is Role.SHADOW

    def to_env(self) -> dict[str, str]:
        """The variables of this contract (``LETO_EVENTS`` / ``LETO_STORE_PREFIX`` /
        ``LETO_AUTH_KEY`` only when set). Use ``worker_environment`` to lay them over a parent
        environment: it also drops a parent's stale values of the ones left out here."""
        env = {
            ROLE: self.role.value, JOB_ID: self.job_id, RUN_DIR: self.run_dir, NODE_RANK: str(self.node_rank),
            GENERATION: str(self.generation), SHADOW_SET: self.shadow_set, SHADOW_LEVEL: str(self.shadow_level),
            RESUME: self.resume.value, FAULTS: json.dumps([dict(f) for f in self.faults]),
        }
        if self.events is not None:
            env[EVENTS] = self.events
        if self.store_prefix:
            env[STORE_PREFIX] = self.store_prefix
        if self.auth_key:
            env[AUTH_KEY] = self.auth_key
        if self.cuda_manager:
            env[CUDA_MANAGER] = self.cuda_manager
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerContract:
        """The contract a launcher wrote into ``environ``; ``ConfigurationError`` naming the
        variable and its value when one is missing or invalid."""
        missing = [name for name in (ROLE, JOB_ID) if name not in environ]
        if missing:
            raise ConfigurationError(
                f"not started by `leto launch` (missing {', '.join(missing)}); run the script with "
                "`leto launch --nproc-per-node N script.py`")
        return cls(
            role=_enum(Role, ROLE, environ[ROLE]), job_id=environ[JOB_ID], run_dir=environ.get(RUN_DIR, "."),
            node_rank=_int(environ, NODE_RANK, 0), generation=_int(environ, GENERATION, 0),
            shadow_set=environ.get(SHADOW_SET, "0"), shadow_level=_int(environ, SHADOW_LEVEL, 3),
            resume=_enum(ResumeMode, RESUME, environ.get(RESUME, "")), faults=_faults(environ),
            events=environ.get(EVENTS), store_prefix=environ.get(STORE_PREFIX, ""),
            auth_key=environ.get(AUTH_KEY, ""), cuda_manager=environ.get(CUDA_MANAGER, ""))


def under_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a trainer process a Leto launcher started (active or shadow)."""
    return ROLE in environ


def worker_environment(base: Mapping[str, str], contract: WorkerContract) -> dict[str, str]:
    """``base`` (the launcher's own environment) without any ``LETO_*`` contract variable it
    inherited, with ``contract``'s: a value the launcher itself was given never leaks into its
    trainers as if it were theirs."""
    env = {k: v for k, v in base.items() if k not in CONTRACT_VARIABLES}
    env.update(contract.to_env())
    return env


def _enum(kind: type[StrEnum], name: str, value: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ConfigurationError(f"{name}={value!r}: choose one of {choices}") from None


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r}: expected an integer") from None


def _faults(environ: Mapping[str, str]) -> tuple[Mapping[str, Any], ...]:
    text = environ.get(FAULTS, "[]")
    try:
        faults = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{FAULTS}={text!r}: not JSON ({exc})") from None
    if not isinstance(faults, list):
        raise ConfigurationError(f"{FAULTS}={text!r}: expected a JSON list of fault objects")
    return tuple(faults)


# -- readers of the knobs (runtime/, integrations/ and the top level pass the values down) ---
_OFF = ("0", "false", "no", "off")


def job_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """``LETO_JOB_PREFIX``: what new job ids start with ("" when unset); pass it to
    ``retained.shm.new_job_id``."""
    return environ.get(JOB_PREFIX, "")


def warm_template_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``LETO_WARM_TEMPLATE``: False when it says 0 / false / no / off (any case), else True --
    the default of ``leto launch``/``leto train``'s warm template (docs/runtime.md)."""
    return environ.get(WARM_TEMPLATE, "1").strip().lower() not in _OFF


def fused_adam_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``LETO_FUSED_ADAM``: False when it says 0 / false / no / off (any case), else True."""
    return environ.get(FUSED_ADAM, "1").strip().lower() not in _OFF


def isal_library(environ: Mapping[str, str] = os.environ) -> str | None:
    """``LETO_ISAL_LIBRARY``: the ISA-L shared library to try first, or None."""
    return environ.get(ISAL_LIBRARY) or None


def cuda_manager(environ: Mapping[str, str] = os.environ) -> str:
    """``LETO_CUDA_MANAGER``: the address of the agent's CUDA state manager new CUDA stores
    allocate from, "" when none (a store then starts a private one)."""
    return environ.get(CUDA_MANAGER, "")


def run_dir(environ: Mapping[str, str] = os.environ) -> str | None:
    """``LETO_RUN_DIR`` when set and not empty, else None."""
    return environ.get(RUN_DIR) or None


@dataclass(frozen=True)
class ProcessSettings:
    """What the process environment tells the layers below ``runtime/``, which never read it:
    runtime/, integrations/ (and the top level) build it with ``from_env`` and pass it down
    (``RetainedStore.create``, ``RetainedOptimizer``, ``create_zero1``, ``create_fsdp2``,
    ``recover_node``, ...). The defaults are what an empty environment says.

    fused_adam:   ``LETO_FUSED_ADAM``: Adam chunks may use the fused kernel (``updater/fused_adam.py``).
    cuda_manager: ``LETO_CUDA_MANAGER``: the agent's CUDA state manager new CUDA stores allocate
                  from; "" starts a private one for the store.
    manager_dir:  ``LETO_RUN_DIR``: where a private state manager's socket goes (None: the
                  temporary directory).
    """

    fused_adam: bool = True
    cuda_manager: str = ""
    manager_dir: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ProcessSettings:
        return cls(fused_adam=fused_adam_enabled(environ), cuda_manager=cuda_manager(environ),
                   manager_dir=run_dir(environ))
