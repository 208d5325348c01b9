"""How much memory a node (and each of its GPUs) has left: the figures the reclaim policy reads.

Sources, tried in this order for the host:
  budget   ``--memory-budget``: the job's own processes against an explicit limit (works anywhere,
           also where the limit is smaller than the machine: how the policy is exercised on a CPU)
  cgroup   cgroup v2 ``memory.max`` / ``memory.current`` of the agent's cgroup, when it has a limit
  meminfo  ``/proc/meminfo``: ``MemTotal`` and ``MemAvailable``
and for each GPU NVML (``pynvml``), when it finds NVIDIA devices: used/free per device and, where
NVML gives it, per process. No NVML or no device means no GPU figures -- not an error.

What the job uses, per process, is ``RssAnon`` from ``/proc/<pid>/status``: the private
(anonymous) memory -- heap, tensors, allocator pools. Shared memory is left out there on purpose
(``RssShmem``): the retained store and its parity live in ``/dev/shm`` (tmpfs, host memory) and
every trainer and shadow maps the same pages, so they are counted once, where they live, by the
allocated blocks of the job's segments. Shared libraries (``RssFile``) are page cache, not counted.
One sample costs one ``/proc/<pid>/status`` read per process and one ``/dev/shm`` listing.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ConfigurationError
from ..retained.shm import SEGMENT_PREFIX, SHM_DIR

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "--memory-budget") -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes; a clear error otherwise."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigurationError(f"{what} {text!r} is not a size: give a number with an optional unit "
                                 "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 2GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigurationError(f"{what} {text!r} must be more than 0 bytes, e.g. 2GiB")
    return size


@dataclass(frozen=True)
class MemoryBudget:
    """An explicit limit for the job on this node (``node_bytes``) and per GPU (``device_bytes``)."""

    node_bytes: int | None = None
    device_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("node_bytes", "device_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigurationError(f"memory budget {name}={value!r} must be a positive number of bytes")


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    total: int
    used: int
    free: int
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes, where NVML gives it


@dataclass(frozen=True)
class MemorySample:
    """One reading. ``free`` is what is left for the job: the limit minus what is used."""

    source: str  # "budget", "cgroup" or "meminfo"
    limit: int
    used: int
    processes: dict[int, int]  # pid -> private bytes (RssAnon) of the job's trainers and shadows
    retained: int  # bytes of the job's /dev/shm segments, counted once
    devices: tuple[DeviceMemory, ...] = ()

    @property
    def free(self) -> int:
        return self.limit - self.used

    @property
    def tightest_free(self) -> int:
        """The least free memory of the host and every GPU: what the policy compares."""
        return min([self.free] + [d.free for d in self.devices])

    def figures(self, pids: dict[str, Iterable[int]] | None = None) -> dict:
        """The sample as an event's fields (MiB, rounded), optionally summed per role."""
        mib = 2 ** 20
        out = {"source": self.source, "limit_mib": round(self.limit / mib, 1), "used_mib": round(self.used / mib, 1),
               "free_mib": round(self.free / mib, 1), "retained_mib": round(self.retained / mib, 1)}
        for role, group in (pids or {}).items():
            out[f"{role}_mib"] = round(sum(self.processes.get(p, 0) for p in group) / mib, 1)
        if self.devices:
            out["devices"] = [{"index": d.index, "used_mib": round(d.used / mib, 1), "free_mib": round(d.free / mib, 1)}
                              for d in self.devices]
        return out


def private_bytes(pid: int) -> int:
    """``RssAnon`` of ``pid`` (0 once it is gone): its private memory, shared memory left out."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def segment_bytes(prefix: str) -> int:
    """Allocated bytes (tmpfs blocks, not the nominal size) of the /dev/shm segments named ``prefix*``."""
    total = 0
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return 0
    for name in names:
        try:
            total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
        except FileNotFoundError:  # removed meanwhile
            pass
    return total


def meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", 0)


def cgroup_limit(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(memory.max, memory.current) of this process's cgroup v2, None without v2 or without a limit."""
    try:
        with open(self_cgroup) as f:
            path = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        where = os.path.join(root, path.lstrip("/"))
        with open(os.path.join(where, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(where, "memory.current")) as f:
            return int(limit), int(f.read().strip())
    except (OSError, ValueError):
        return None


class NvmlDevices:
    """NVML's view of this node's GPUs; ``available`` is False without pynvml, driver or devices."""

    def __init__(self) -> None:
        self.available = False
        self._nvml = None
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self.count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.debug("NVML not usable (%s): no GPU memory figures", exc)
            return
        self._nvml = pynvml
        self.available = self.count > 0

    def read(self, budget: int | None, job_pids: set[int]) -> tuple[DeviceMemory, ...]:
        nv, out = self._nvml, []
        if not self.available or nv is None:
            return ()
        for index in range(self.count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                info = nv.nvmlDeviceGetMemoryInfo(handle)
                procs = {p.pid: int(p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)}
            except nv.NVMLError as exc:  # a device that stops answering is the classifier's business
                log.warning("NVML could not read device %d's memory (%s)", index, exc)
                continue
            total, used, free = int(info.total), int(info.used), int(info.free)
            if budget is not None:  # the job's share: its processes against the budget, never above what is free
                mine = sum(b for pid, b in procs.items() if pid in job_pids)
                total, used, free = budget, mine, min(free, budget - mine)
            out.append(DeviceMemory(index, total, used, free, procs))
        return tuple(out)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


class MemoryProbe:
    """Reads the node's memory figures for one job: ``pids()`` are its trainers and shadows,
    ``job_ids()`` the retained-memory job ids whose /dev/shm segments it owns."""

    def __init__(self, budget: MemoryBudget, pids: Callable[[], Iterable[int]],
                 job_ids: Callable[[], Iterable[str]], gpus: bool = True) -> None:
        self.budget = budget
        self._pids, self._job_ids = pids, job_ids
        self.gpus = NvmlDevices() if gpus else None

    def sample(self) -> MemorySample:
        pids = set(self._pids())
        processes = {pid: private_bytes(pid) for pid in pids}
        retained = sum(segment_bytes(SEGMENT_PREFIX + job + "-") for job in self._job_ids())
        job_used = sum(processes.values()) + retained
        devices = self.gpus.read(self.budget.device_bytes, pids) if self.gpus is not None else ()
        if self.budget.node_bytes is not None:
            return MemorySample("budget", self.budget.node_bytes, job_used, processes, retained, devices)
        cgroup = cgroup_limit()
        if cgroup is not None:
            return MemorySample("cgroup", cgroup[0], cgroup[1], processes, retained, devices)
        total, available = meminfo()
        return MemorySample("meminfo", total, total - available, processes, retained, devices)

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()
