"""NVIDIA Xid events of this node's GPUs, for classifying a failure as a HOF or not.

A trainer that dies after an Xid 79 (the GPU fell off the bus) must not be recovered in place on
that GPU; after an Xid 13 (a graphics engine exception) or 94 (a contained ECC error) it can be
(docs/design.md section 1). NVML delivers Xids only to event sets registered *before* they
happen, so the agent registers one per device when the job starts and drains it when it
classifies a failure. Without NVML (``nvidia-ml-py``) or where the driver does not deliver
events the monitor says so once and classification falls back to the exit and the rule table
(``classify.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Xids after which the GPU needs a reset, a reboot or a replacement: not hardware-operable.
# 48 double-bit ECC, 64 row-remap failure, 74 NVLink error, 79 fell off the bus, 95 uncontained
# ECC, 119/120 GSP errors, 140 unrecovered ECC. Everything else (13 graphics engine exception,
# 31 MMU fault, 43 stopped processing, 45 preemptive cleanup, 63/92 row remap / excess single-bit
# ECC, 94 contained ECC) leaves the device usable once the faulting process is gone.
XID_NEEDS_RESET = frozenset({48, 64, 74, 79, 95, 119, 120, 140})


def xid_verdict(xids: list[int]) -> tuple[bool, str]:
    """(operable, why) for the Xids a device reported since the last failure."""
    fatal = sorted({x for x in xids if x in XID_NEEDS_RESET})
    if fatal:
        return False, f"Xid {', '.join(map(str, fatal))}: the GPU needs a reset or replacement"
    if xids:
        return True, f"Xid {', '.join(map(str, sorted(set(xids))))}: the device stays usable"
    return True, "no Xid"


@dataclass
class XidMonitor:
    """One NVML event set over this node's GPUs, registered for critical Xid errors."""

    nvml: Any = None
    event_set: Any = None
    handles: dict[int, Any] = field(default_factory=dict)  # device index -> NVML handle
    note: str = ""  # why there is no monitor (said once, at start)

    @classmethod
    def start(cls) -> XidMonitor:
        try:
            import pynvml
        except ImportError:
            return cls(note="NVML missing (pip install 'leto-lightning[cuda]'): a GPU failure is classified by "
                            "its exit and the rule table only, without Xid events or device health")
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            return cls()  # no NVIDIA driver: a CPU job, nothing to say
        if count == 0:
            return cls(nvml=pynvml)
        event_set = pynvml.nvmlEventSetCreate()
        handles = {}
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
                handles[index] = handle
            except pynvml.NVMLError as exc:
                log.info("GPU %d delivers no Xid events (%s): classified without them", index, exc)
        return cls(pynvml, event_set, handles)

    def drain(self) -> dict[int, list[int]]:
        """The Xids each device reported since the last drain (a device index -> its Xids)."""
        if self.event_set is None:
            return {}
        pynvml = self.nvml
        by_index = {pynvml.nvmlDeviceGetIndex(h): i for i, h in self.handles.items()}
        found: dict[int, list[int]] = {}
        while True:
            try:
                data = pynvml.nvmlEventSetWait_v2(self.event_set, 0)
            except pynvml.NVMLError:  # Timeout: nothing (more) pending
                return found
            index = by_index.get(pynvml.nvmlDeviceGetIndex(data.device), -1)
            found.setdefault(index, []).append(int(data.eventData))

    def close(self) -> None:
        if self.event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self.event_set)
            except self.nvml.NVMLError:
                pass
            self.event_set = None
