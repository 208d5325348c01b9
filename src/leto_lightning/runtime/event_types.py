"""The events of ``events.jsonl`` (docs/events.md), one frozen dataclass each.

An event's class names it (``NAME``, the JSON ``event`` string) and types its fields (the JSON
fields, in the order they are written). ``EventLog.write`` (``events.py``) is the one writer:
``to_record`` adds ``time`` and ``generation`` and the event's fields; a field declared with
``metadata=OMIT_IF_NONE`` is left out of the record while it is None (e.g. ``recovery_finished``'s
``interrupted``), every other field is written, None as ``null``. ``from_record`` is the one
reader: it parses a record by its name into its class, ignores fields it does not know, reads a
field a record lacks (a log of an older version) as None, and keeps an event it does not know as
an ``UnknownEvent``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..env import ResumeMode, Role
from ..errors import InternalError
from .classify import FailedRole
from .messages import TrainerPhase
from .recovery_books import Resumption

COMMON = ("time", "event", "generation")  # every record's fields
_OMIT = "omitted_if_none"
OMIT_IF_NONE = {_OMIT: True}  # the metadata of a field left out of the record while it is None (absent, not null)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One record of the event log; ``time`` is set when it is read back (the writer stamps the
    time of writing)."""

    NAME: ClassVar[str] = ""
    generation: int
    time: float = field(default=0.0, compare=False)


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A record whose event this version does not know (a newer writer): its name and fields."""

    event: str
    fields: dict[str, Any]


# -- the job ---------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class JobStarted(Event):
    NAME = "job_started"
    port: int
    world_size: int
    job_id: str
    node_rank: int
    script: str
    pid: int


@dataclass(frozen=True, kw_only=True)
class JobStopped(Event):
    NAME = "job_stopped"
    reason: str


@dataclass(frozen=True, kw_only=True)
class JobInterrupted(Event):
    NAME = "job_interrupted"
    signal: int


@dataclass(frozen=True, kw_only=True)
class JobFinished(Event):
    NAME = "job_finished"
    exit_code: int
    recoveries: int


@dataclass(frozen=True, kw_only=True)
class RunDirLockTakenOver(Event):
    NAME = "run_dir_lock_taken_over"
    previous: dict[str, Any] | None  # pid, host, started


# -- trainers and shadows --------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ProcessStarted(Event):
    NAME = "process_started"
    rank: int
    role: Role
    pid: int
    shadow_set: str | None
    resume: ResumeMode | None  # None for a fresh start
    forked: bool


@dataclass(frozen=True, kw_only=True)
class WarmTemplateReport(Event):
    NAME = "warm_template"
    ready: bool
    reason: str | None
    import_s: float
    modules: int


@dataclass(frozen=True, kw_only=True)
class ShadowLevelReached(Event):
    NAME = "shadow_level"
    shadow_set: str
    level: int
    reason: str  # started, ready


@dataclass(frozen=True, kw_only=True)
class ShadowFailed(Event):
    NAME = "shadow_failed"
    rank: int
    pid: int | None
    exit_code: int | None
    signal: int | None
    shadow_set: str | None


# -- memory reclaim: the sample's figures are ``memory.MemorySample.figures`` ----------------

@dataclass(frozen=True, kw_only=True)
class ShadowLevelChanged(Event):
    NAME = "shadow_level_changed"
    old: int
    new: int
    reason: str
    source: str
    limit_mib: float
    used_mib: float
    free_mib: float
    retained_mib: float
    active_mib: float | None = field(default=None, metadata=OMIT_IF_NONE)
    shadow_mib: float | None = field(default=None, metadata=OMIT_IF_NONE)
    devices: list[dict[str, Any]] | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True, kw_only=True)
class MemoryOverBudget(Event):
    NAME = "memory_over_budget"
    level: int
    reclaim: bool
    source: str
    limit_mib: float
    used_mib: float
    free_mib: float
    retained_mib: float
    active_mib: float | None = field(default=None, metadata=OMIT_IF_NONE)
    shadow_mib: float | None = field(default=None, metadata=OMIT_IF_NONE)
    devices: list[dict[str, Any]] | None = field(default=None, metadata=OMIT_IF_NONE)


# -- failures and recoveries -----------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class FailureDetected(Event):
    NAME = "failure_detected"
    rank: int
    pid: int | None
    role: FailedRole
    exit_code: int | None
    signal: int | None
    exception: str | None
    hang: bool
    phase: TrainerPhase | None
    iteration: int | None


@dataclass(frozen=True, kw_only=True)
class Classification(Event):
    NAME = "classification"
    rank: int
    hof: bool
    reason: str
    device: str
    node: int


@dataclass(frozen=True, kw_only=True)
class RecoveryStarted(Event):
    NAME = "recovery_started"
    cause_rank: int
    hof: bool


@dataclass(frozen=True, kw_only=True)
class ShadowsPromoted(Event):
    NAME = "shadows_promoted"
    shadow_set: str


@dataclass(frozen=True, kw_only=True)
class ColdStart(Event):
    NAME = "cold_start"
    reason: str


@dataclass(frozen=True, kw_only=True)
class RecoveryFailed(Event):
    NAME = "recovery_failed"
    rank: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class RecoveryFinished(Event):
    """A recovery's books: ``interrupted`` (and no ``total_s``, ``repair``, ``shadow_level``)
    when another failure came before its first iteration."""

    NAME = "recovery_finished"
    interrupted: bool | None = field(default=None, metadata=OMIT_IF_NONE)
    breakdown: dict[str, float]
    first_iteration_s: float | None
    total_s: float | None = field(default=None, metadata=OMIT_IF_NONE)
    resume_iteration: int | None
    failed_iteration: int | None
    promoted: Resumption
    repair: list[str] | None = field(default=None, metadata=OMIT_IF_NONE)
    shadow_level: int | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True, kw_only=True)
class FallbackCheckpoint(Event):
    NAME = "fallback_checkpoint"
    reason: str


@dataclass(frozen=True, kw_only=True)
class NodeLostEvent(Event):
    """A node's agent stopped beating: its slot, the agent that held it, the spare taking over
    (None: none left, the job stops)."""

    NAME = "node_lost"
    node: int
    agent: int
    spare: int | None


@dataclass(frozen=True, kw_only=True)
class NodeRetired(Event):
    """This node left the job: its failure was not a HOF and a spare was free."""

    NAME = "node_retired"
    reason: str


@dataclass(frozen=True, kw_only=True)
class SpareJoined(Event):
    """This spare agent took over a lost node's slot after waiting warm for ``waited_s``."""

    NAME = "spare_joined"
    node: int
    spare: int
    waited_s: float


@dataclass(frozen=True, kw_only=True)
class StateTransferred(Event):
    """One side of moving a lost node's retained state from a replica node to its spare."""

    NAME = "state_transferred"
    node: int
    source: int
    side: str  # "source" or "receiver"
    bytes: int
    seconds: float
    pages_verified: int | None  # the receiver: pages checked against the source's page checksums
    problem: str | None


@dataclass(frozen=True, kw_only=True)
class CheckpointRestartFinished(Event):
    NAME = "checkpoint_restart_finished"
    total_s: float
    failed_iteration: int | None
    first_iteration: int
    recompute_iterations: int | None


# -- the control plane -----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ControlMessageRejected(Event):
    NAME = "control_message_rejected"
    key: str
    reason: str
    reader: str  # "agent" or "rank R role"
    pid: int


@dataclass(frozen=True, kw_only=True)
class ControlKeyMissing(Event):
    NAME = "control_key_missing"
    key: str


EVENT_TYPES: dict[str, type[Event]] = {cls.NAME: cls for cls in (
    JobStarted, JobStopped, JobInterrupted, JobFinished, RunDirLockTakenOver, ProcessStarted, WarmTemplateReport,
    ShadowLevelReached, ShadowFailed, ShadowLevelChanged, MemoryOverBudget, FailureDetected, Classification,
    RecoveryStarted, ShadowsPromoted, ColdStart, RecoveryFailed, RecoveryFinished, FallbackCheckpoint,
    CheckpointRestartFinished, NodeLostEvent, NodeRetired, SpareJoined, StateTransferred, ControlMessageRejected,
    ControlKeyMissing)}


def payload_fields(cls: type[Event]) -> tuple[dataclasses.Field, ...]:
    """An event class's own fields (those besides ``time`` and ``generation``), in written order."""
    return tuple(f for f in dataclasses.fields(cls) if f.name not in COMMON)


def to_record(event: Event, now: float) -> dict[str, Any]:
    """The JSON object of ``event`` written at ``now``."""
    if isinstance(event, UnknownEvent) or type(event).NAME not in EVENT_TYPES:
        raise InternalError(f"{type(event).__name__} is not an event class of the log: add it to EVENT_TYPES")
    record: dict[str, Any] = {"time": now, "event": event.NAME, "generation": event.generation}
    for f in payload_fields(type(event)):
        value = getattr(event, f.name)
        if value is not None or not f.metadata.get(_OMIT):
            record[f.name] = value
    return record


def from_record(record: dict[str, Any]) -> Event:
    """The event object of one record (module doc)."""
    name = str(record["event"])
    at, generation = float(record.get("time") or 0.0), int(record.get("generation") or 0)
    cls = EVENT_TYPES.get(name)
    if cls is None:
        rest = {k: v for k, v in record.items() if k not in COMMON}
        return UnknownEvent(event=name, fields=rest, time=at, generation=generation)
    enums = _enum_fields(cls)
    values: dict[str, Any] = {}
    for f in payload_fields(cls):
        value = record.get(f.name)
        if f.name in enums and value is not None:
            value = _as_enum(enums[f.name], value)
        values[f.name] = value
    return cls(time=at, generation=generation, **values)


def _as_enum(kind: type[enum.Enum], value: Any) -> Any:
    try:
        return kind(value)
    except ValueError:  # a value a newer version added: kept as written
        return value


_ENUM_FIELDS: dict[str, dict[str, type[enum.Enum]]] = {}


def _enum_fields(cls: type[Event]) -> dict[str, type[enum.Enum]]:
    """{field name: its enum type} for the fields typed with an enum (optional or not)."""
    known = _ENUM_FIELDS.get(cls.NAME)
    if known is None:
        known = {}
        for name, hint in typing.get_type_hints(cls).items():
            args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            kinds = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
            if kinds:
                known[name] = kinds[0]
        _ENUM_FIELDS[cls.NAME] = known
    return known
