"""POSIX shared-memory segments: the CPU backing of retained memory.

A segment outlives the process that maps it: it stays in ``/dev/shm`` until it is unlinked.
That is exactly the property Leto needs (a trainer's death frees nothing retained), and also
the reason every segment carries a job-unique prefix and is removed explicitly when the job
ends (``unlink_segments``) -- a leak would survive the test or job that made it.

We use ``_posixshmem.shm_open`` + ``mmap`` rather than ``multiprocessing.shared_memory``:
on Python < 3.13 the latter registers even *attached* segments with the resource tracker,
which unlinks them when the attaching process (a trainer) exits -- the opposite of retention.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigurationError, IncompleteStoreError, SharedMemoryCapacityError, UsageError

try:  # CPython's private helper, present on every POSIX build
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "leto-"
SIZING_WAIT_S = 5.0  # how long an attacher waits for a segment's creator to give it its size


def shm_free_bytes() -> int:
    """What an unprivileged process may still allocate in ``/dev/shm`` (``statvfs``)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def require_capacity(nbytes: int, what: str) -> None:
    """Raise ``SharedMemoryCapacityError`` (one line: sizes, the fix) when ``/dev/shm`` cannot
    hold ``nbytes`` more."""
    free = shm_free_bytes()
    if nbytes > free:
        raise _too_small(what, nbytes, free)


def _too_small(what: str, nbytes: int, free: int) -> SharedMemoryCapacityError:
    return SharedMemoryCapacityError(
        f"{SHM_DIR} has {_mib(free)} free, {what} needs {_mib(nbytes)}: enlarge it (docker run --shm-size, "
        f"mount -o remount,size=... {SHM_DIR}) or free it (`leto cleanup`), or retain less per node (fewer ranks per "
        "node, a smaller model or less parity)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def new_job_id(prefix: str = "") -> str:
    """A short random id that makes segment names unique per job (and per test).

    ``prefix`` is prepended: the launchers, the integrations and ``leto_lightning.new_job_id``
    pass ``LETO_JOB_PREFIX`` (``env.job_prefix()``), which a test session sets so its leak
    checks see only its own segments, even with other jobs running on the machine.
    """
    return prefix + secrets.token_hex(6)


def segment_name(job_id: str, *parts: object) -> str:
    return SEGMENT_PREFIX + job_id + "-" + "-".join(str(p) for p in parts)


@dataclass
class SharedSegment:
    """One mapped POSIX shared-memory segment, exposed as a flat ``torch.uint8`` tensor."""

    name: str
    nbytes: int
    owner: bool = False
    _tensor: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(cls, name: str, nbytes: int) -> SharedSegment:
        """Create a new zero-filled segment readable and writable only by this user (0600)."""
        if nbytes <= 0:
            raise ConfigurationError(f"segment {name!r}: size must be positive, got {nbytes}")
        fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            require_capacity(nbytes, f"segment {name}")  # else reserving it would first take what is free
            os.ftruncate(fd, nbytes)  # sized at once: an attacher waits for this (``_sized``)
            _reserve(fd, name, nbytes)
        except BaseException:
            os.close(fd)
            unlink_segment(name)
            raise
        os.close(fd)
        try:
            mapped = _map(name, nbytes)
        except BaseException:
            unlink_segment(name)
            raise
        return cls(name=name, nbytes=nbytes, owner=True, _tensor=mapped)

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        """Map an existing segment (e.g. from a shadow trainer after the active one died)."""
        fd = _shm_open(name, os.O_RDWR, 0o600)  # checked as ours, no link, sized, before mapping it
        try:
            nbytes = _sized(fd, name)
        finally:
            os.close(fd)
        return cls(name=name, nbytes=nbytes, owner=False, _tensor=_map(name, nbytes))

    @property
    def tensor(self) -> torch.Tensor:
        """The whole segment as a writable uint8 tensor (a view, no copy)."""
        if self._tensor is None:
            raise UsageError(f"segment {self.name!r} is closed")
        return self._tensor

    def close(self) -> None:
        """Drop this process's reference to the mapping; the segment itself stays until unlinked.

        The mapping belongs to the tensor's storage: it is released when the last tensor viewing
        it is collected, so a view that outlives ``close`` (a model's parameters after the store
        was freed) never points into unmapped memory, and no file descriptor is held meanwhile.
        """
        self._tensor = None

    def unlink(self) -> None:
        unlink_segment(self.name)


def _map(name: str, nbytes: int) -> torch.Tensor:
    """The segment as a writable uint8 tensor, ``MAP_SHARED`` by torch's file mapping: the
    mapping lives exactly as long as the storage (every view of it), and torch closes the file
    descriptor once mapped (``mmap.mmap`` would keep a duplicate open for its whole life)."""
    return torch.from_file(os.path.join(SHM_DIR, name), shared=True, size=nbytes, dtype=torch.uint8)


def _reserve(fd: int, name: str, nbytes: int) -> None:
    """Back every page of the segment now: a full ``/dev/shm`` (another rank of the node, another
    job took the space meanwhile) is an error here, not a SIGBUS at the first write of a page."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _too_small(f"segment {name}", nbytes, shm_free_bytes()) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV):
            raise  # else a filesystem that cannot reserve: its pages are backed at first touch


def _sized(fd: int, name: str) -> int:
    """The segment's size, once its creator has set it. Why wait: ``create`` is ``shm_open``
    then ``ftruncate``, so a peer that attaches in between (the node's ranks racing for the
    shared tier-2 segment, on a loaded machine) finds an empty file. Every created segment has
    a positive size, so an empty one is one being created -- or one whose creator died in
    between, which stays empty and is refused after ``SIZING_WAIT_S``."""
    wait_s = SIZING_WAIT_S
    deadline, pause = time.monotonic() + wait_s, 0.001
    while (nbytes := os.fstat(fd).st_size) == 0:
        if time.monotonic() >= deadline:
            raise IncompleteStoreError(f"segment {name!r} is still empty after {wait_s:g} s: its creator died "
                                       "before sizing it. Start the job again (from its last checkpoint).")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return nbytes


def _shm_open(name: str, flags: int, mode: int) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, mode)
    return os.open(os.path.join(SHM_DIR, name), flags, mode)  # pragma: no cover


def unlink_segment(name: str) -> bool:
    """Remove one segment; returns False when it was already gone."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of the segments in /dev/shm starting with ``prefix`` (leak checks, cleanup)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return []


def unlink_segments(job_id: str) -> list[str]:
    """Remove every segment of one job; returns the names removed."""
    removed = [n for n in list_segments(SEGMENT_PREFIX + job_id + "-") if unlink_segment(n)]
    return removed
