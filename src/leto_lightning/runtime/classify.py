"""Is a failure hardware-operable (in-place recovery) or not (checkpoint path)?

Inputs: how the trainer ended (exit code, signal, reported exception, hang) and the device's
health. Device health comes from NVML on NVIDIA machines (the device answers, no pending page
retirement, no row-remap failure); on a CPU-only machine the "device" is the host and is
operable. NVML missing means no NVIDIA device, not an error.
"""

from __future__ import annotations

import re
import signal as _signal
import time
from dataclasses import dataclass, field
from enum import StrEnum

from ..env import Role
from .config import ClassificationRule, RuntimeConfig
from .messages import TrainerPhase, Verdict
from .spec import LaunchSpec
from .xid import xid_verdict


class FailedRole(StrEnum):
    """Whose failure it is: this node's active trainer or waiting shadow, or a trainer of
    another node (``REMOTE``: known from that node's verdict only)."""

    ACTIVE = Role.ACTIVE.value
    SHADOW = Role.SHADOW.value
    REMOTE = "remote"
    NODE = "node"  # a whole node: its agent stopped beating (runtime/membership.py)


@dataclass(frozen=True)
class Failure:
    rank: int
    pid: int | None
    role: FailedRole = FailedRole.ACTIVE
    exit_code: int | None = None
    signal: int | None = None
    exception: str | None = None
    hang: bool = False
    iteration: int | None = None
    phase: TrainerPhase | None = None  # the last heartbeat's
    detected_at: float = 0.0
    last_heartbeat: float | None = None
    remote_verdict: Verdict | None = None  # set when another node's agent classified it
    hung_since: float | None = None  # a hang: the last sign of progress (its last heartbeat, or when the
    # agent began waiting for one): the recovery breakdown's ``detect`` starts there

    @property
    def exception_type(self) -> str | None:
        """The reported exception's type name (``"ValueError: ..."`` -> ``"ValueError"``)."""
        return exception_type(self.exception)

    def kind(self) -> str | None:
        """What kind of failure this is, whatever its message says (a pid, a time, an address):
        ``"SIGSEGV"``, the exception's type, or ``"exit code N"``. None for what says nothing
        about the trainer itself: a hang, another node's failure, a SIGKILL (an OOM kill, an
        operator, a fault injected)."""
        if self.hang or self.pid is None or self.remote_verdict is not None:
            return None
        if self.signal is not None:
            return None if self.signal == _signal.SIGKILL else _signal.Signals(self.signal).name
        if self.exception_type is not None:
            return self.exception_type
        return f"exit code {self.exit_code}" if self.exit_code is not None else None

    def describe(self) -> str:
        if self.role is FailedRole.NODE:
            return self.exception or f"the node of rank {self.rank} lost"
        if self.hang:
            return f"rank {self.rank} hung (no heartbeat)"
        if self.signal is not None:
            return f"rank {self.rank} killed by {_signal.Signals(self.signal).name}"
        said = f" ({self.exception})" if self.exception else ""
        return f"rank {self.rank} exited with code {self.exit_code}{said}"


def node_lost_failure(nodes: list[int], spec: LaunchSpec, why: str) -> Failure:
    """The failure of whole nodes (their agents, trainers, memory and devices): named by the
    first rank of the first."""
    return Failure(rank=nodes[0] * spec.nproc_per_node, pid=None, role=FailedRole.NODE, detected_at=time.time(),
                   exception=f"node(s) {nodes} lost: {why}")


_REPORTED = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")  # what a trainer reports: "<type name>: <message>"
# the last line of a Python traceback, e.g. "torch.distributed.DistBackendError: ..." (names of exception types only)
_PRINTED = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault)(?::\s|$)")


def exception_type(reported: str | None) -> str | None:
    """The type name at the start of a reported exception (its last dotted part), or None."""
    match = _REPORTED.match((reported or "").strip())
    return match.group(1).rsplit(".", 1)[-1] if match else None


def printed_exception(line: str) -> str | None:
    """``line`` when it is the last line of a Python traceback (``"<Type>Error: message"``)."""
    line = line.strip()
    return line if _PRINTED.match(line) else None


@dataclass(frozen=True)
class DeviceHealth:
    operable: bool
    source: str
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Classification:
    hof: bool
    reason: str
    device: DeviceHealth
    stop: bool = False  # no restart can help: stop the job


def device_health(local_rank: int, xids: list[int] | None = None) -> DeviceHealth:
    """Ask NVML about the device of ``local_rank``, with the Xids it reported since the last
    failure (``xid.XidMonitor``); no NVML means a CPU job (operable)."""
    try:
        import pynvml
    except ImportError:
        return DeviceHealth(True, "no NVML (nvidia-ml-py not installed): CPU job, or a GPU job classified by its "
                                  "exit and rules only")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return DeviceHealth(True, "no NVIDIA device (NVML library not found): CPU job")
    try:
        health = _nvml_health(pynvml, local_rank)
        if xids and health.operable:
            operable, why = xid_verdict(xids)
            health = DeviceHealth(operable, f"NVML: {why}", {**health.details, "xids": sorted(set(xids))})
        return health
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _nvml_health(pynvml, index: int) -> DeviceHealth:
    details: dict = {}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        details["name"] = pynvml.nvmlDeviceGetName(handle)
    except pynvml.NVMLError as exc:  # the device does not answer: fell off the bus / needs reset
        return DeviceHealth(False, f"NVML: device {index} does not answer ({exc})", details)
    for probe, key in ((pynvml.nvmlDeviceGetRetiredPagesPendingStatus, "retired_pages_pending"),):
        try:
            details[key] = bool(probe(handle))
        except pynvml.NVMLError:
            pass
    try:
        remap = pynvml.nvmlDeviceGetRemappedRows(handle)  # (corr, uncorr, pending, failure)
        details["row_remap_pending"], details["row_remap_failure"] = bool(remap[2]), bool(remap[3])
    except (pynvml.NVMLError, AttributeError):
        pass
    if details.get("row_remap_failure"):
        return DeviceHealth(False, "NVML: row-remap failure: the GPU needs a reset", details)
    if details.get("retired_pages_pending") or details.get("row_remap_pending"):
        return DeviceHealth(False, "NVML: page retirement / row remap pending: reset required", details)
    return DeviceHealth(True, "NVML: device answers, no pending retirement or remap", details)


def classify(failure: Failure, config: RuntimeConfig, health: DeviceHealth) -> Classification:
    if not health.operable:
        return Classification(False, f"device not operable: {health.source}", health)
    for rule in config.all_rules:
        if _matches(rule, failure):
            return Classification(rule.hof, rule.reason, health, rule.stop)
    return Classification(config.unknown_is_hof, "no rule matched: unknown_is_hof", health)


def stops_the_job(failure: Failure, config: RuntimeConfig) -> bool:
    """A rule says no restart can help (a full disk, a too small /dev/shm): whatever the device."""
    rule = next((r for r in config.all_rules if _matches(r, failure)), None)
    return rule is not None and rule.stop


def _matches(rule: ClassificationRule, f: Failure) -> bool:
    checks = []
    if rule.exit_code is not None:
        checks.append(f.exit_code == rule.exit_code)
    if rule.signal is not None:
        checks.append(f.signal == rule.signal)
    if rule.exception is not None:
        checks.append(bool(f.exception and rule.exception in f.exception))
    if rule.exception_type is not None:
        checks.append(f.exception_type == rule.exception_type)
    if rule.hang is not None:
        checks.append(f.hang == rule.hang)
    return bool(checks) and all(checks)
