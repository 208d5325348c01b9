"""The typed messages the agents and trainers exchange through the job's store (``keys.py``).

Each type has one writer (``to_json``; ``to_dict`` for a value inside a lockstep step) and one
reader (``from_json`` / ``from_dict``); the store holds the JSON.

- ``Heartbeat``    trainer -> agent (``keys.HEARTBEAT``): progress of an active trainer
- ``ResumeInfo``   trainer -> agent (``keys.RESUMED``): a trainer resumed after a recovery
- ``Promotion``    agent -> shadows (``keys.PROMOTE``): the shadow set becomes the generation's actives
- ``Verdict``      agent -> agents (``keys.FAILURE``): the job-wide classification of a failure
- ``NodeSummary``  agent -> agents (``keys.NODE_STEP``, step ``summary``): each rank's progress
  record as this node found it (``updater.recovery.RankProgress``), or why this node could not
  repair its stores
- ``NodeAssignment`` agent -> agents and the spare (``keys.SPARE_ASSIGN``, ``keys.SLOT_HOLDER``):
  a spare takes over a lost node's slot
- ``TransferManifest`` source agent -> spare (``keys.TRANSFER_MANIFEST``): the segments it sends
  over the transfer's process group, each with its SHA-256 (the channel itself is unsigned)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, ClassVar, Protocol, TypeVar

from ..errors import InternalError
from ..updater.recovery import RankProgress


def _fields(raw: bytes | str, what: str) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise InternalError(f"{what}: expected a JSON object in the store, got {raw!r}")
    return value


class TrainerPhase(str, Enum):
    """Where an active trainer is in its iteration, as its heartbeat says: a failure in
    ``COMPUTE`` loses that iteration's forward/backward (redone), one in ``UPDATE`` is rolled
    forward or back by the chunk transactions, ``DONE`` and the rest are between iterations (a
    Lightning trainer between steps says where: validation, an epoch's end, a checkpoint)."""

    COMPUTE = "compute"
    UPDATE = "update"
    DONE = "done"
    VALIDATION = "validation"
    EPOCH_END = "epoch_end"
    CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Heartbeat:
    t: float  # when the trainer sent it (Unix seconds)
    it: int  # the iteration it is in
    phase: TrainerPhase
    pid: int
    gen: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", TrainerPhase(self.phase))  # a phase name: one of the enum's, or refused

    def to_json(self) -> str:
        return json.dumps(dict(asdict(self), phase=self.phase.value))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat | None:
        """None for the empty value the agent writes before a trainer's first heartbeat."""
        if not raw:
            return None
        return cls(**_fields(raw, "heartbeat"))


@dataclass(frozen=True)
class ResumeInfo:
    init_s: float  # what the promoted trainer still had to build after its promotion
    resume_s: float  # re-binding to retained state and restoring the loop position
    iteration: int  # where it resumes
    t: float  # when it resumed (Unix seconds)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ResumeInfo:
        return cls(**_fields(raw, "resume info"))


@dataclass(frozen=True)
class FirstDone:
    """A trainer finished its first iteration of a generation (``keys.FIRST_DONE``)."""

    t: float  # when (Unix seconds)
    it: int  # which iteration it was

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> FirstDone:
        return cls(**_fields(raw, "first iteration"))


@dataclass(frozen=True)
class Promotion:
    generation: int  # the generation the promoted shadows train in

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Promotion:
        return cls(**_fields(raw, "promotion"))


@dataclass(frozen=True)
class Verdict:
    """The job-wide decision on one generation's failure: the first node to publish decides."""

    rank: int
    hof: bool
    reason: str
    device: str  # where the device's health came from (NVML, or a CPU job)
    node: int  # the node that classified it
    stop: bool = False  # no restart can help: stop the job
    replace: bool = False  # not a HOF, and a spare is free: the node leaves, a spare takes its slot

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Verdict:
        return cls(**_fields(raw, "failure verdict"))


@dataclass(frozen=True)
class NodeSummary:
    """What one node's agent found in its stores; ``failed`` says why it could not look."""

    STEP: ClassVar[str] = "summary"  # the recovery's lockstep step that carries it
    node: int
    ranks: tuple[tuple[int, RankProgress | None], ...] = ()
    failed: str | None = None

    def to_dict(self) -> dict[str, Any]:
        ranks = {str(r): (None if p is None else list(p)) for r, p in self.ranks}
        return {"node": self.node, "ranks": ranks, "failed": self.failed}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> NodeSummary:
        ranks = tuple((int(r), None if p is None else RankProgress.of(p)) for r, p in value["ranks"].items())
        return cls(int(value["node"]), ranks, value.get("failed"))


class LockstepMessage(Protocol):
    """What a node's agent sends at one lockstep step of a recovery (``NodeLockstep.sync``):
    the step's name is the type's, so a step carries one kind of message."""

    STEP: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> Any: ...


M = TypeVar("M", bound=LockstepMessage)


@dataclass(frozen=True)
class NodeStopped:
    """This node's trainers are stopped: no node touches retained state while another trains."""

    STEP: ClassVar[str] = "stopped"

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> NodeStopped:
        return cls()


@dataclass(frozen=True)
class NodeRecovered:
    """This node's stores after repair: why they cannot be used, else where they resume."""

    STEP: ClassVar[str] = "recovered"
    problem: str | None
    resume: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> NodeRecovered:
        return cls(value.get("problem"), value.get("resume"))


@dataclass(frozen=True)
class NodeShadowsReady:
    """This node's shadow set can be promoted (a promotion happens only if every node's can)."""

    STEP: ClassVar[str] = "shadows_ready"
    ready: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> NodeShadowsReady:
        return cls(bool(value["ready"]))


@dataclass(frozen=True)
class NodeAssignment:
    """Spare agent ``spare`` (its launch node rank) holds node slot ``node`` from ``generation`` on."""

    node: int
    generation: int
    spare: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeAssignment:
        return cls(**_fields(raw, "node assignment"))


@dataclass(frozen=True)
class SegmentDigest:
    """One segment a transfer sends: which (``r<local rank>-<what>`` or ``parity2``), its size
    and SHA-256."""

    name: str
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class TransferManifest:
    """What the source node sends the spare of ``node`` (in this order), or why it cannot."""

    source: int  # the node slot that sends (-1: none could)
    segments: tuple[SegmentDigest, ...] = ()
    problem: str | None = None
    mode: str | None = None  # "replica" or "mirror" (runtime/transfer.py)

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "segments": [asdict(d) for d in self.segments],
                           "problem": self.problem, "mode": self.mode})

    @classmethod
    def from_json(cls, raw: bytes | str) -> TransferManifest:
        value = _fields(raw, "transfer manifest")
        return cls(int(value["source"]), tuple(SegmentDigest(**d) for d in value["segments"]), value.get("problem"),
                   value.get("mode"))
