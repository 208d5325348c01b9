"""Kill a process at a chosen injection point with a real SIGKILL.

The child runs the work with a hook installed; when it reaches the ``nth`` occurrence of the
chosen point it reports through a pipe and blocks; the parent then sends signal 9. Nothing in
the child gets to clean up -- exactly what a dying trainer leaves behind.

Children are ``fork``ed from a parent that already imported torch (a fresh interpreter costs
seconds here), and every child is reaped by pid before the call returns.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import LetoError, LetoTimeoutError
from ..faults.points import set_hook


@dataclass(frozen=True)
class KillPoint:
    name: str
    occurrence: int = 1  # 1 = the first time the point is reached

    def __str__(self) -> str:
        return f"{self.name}#{self.occurrence}"


class PointRecorder:
    """A hook that lists every point reached, in order (a dry run to choose kill points)."""

    def __init__(self) -> None:
        self.points: list[KillPoint] = []
        self._counts: Counter[str] = Counter()

    def __call__(self, name: str, context: dict) -> None:
        self._counts[name] += 1
        self.points.append(KillPoint(name, self._counts[name]))


@dataclass(frozen=True)
class KillAfter:
    """Kill ``seconds`` after the child first reaches point ``start`` (a kill at a random *time*,
    not at a named point: ``seconds`` drawn by the caller, e.g. uniform over a measured step)."""

    start: str
    seconds: float

    def __str__(self) -> str:
        return f"{self.start}+{self.seconds * 1e3:.2f}ms"


@dataclass
class ChildResult:
    killed: bool  # True: the child reached the kill point and got SIGKILL
    exit_code: int | None
    signal: int | None
    value: object = None  # what the function returned (when it finished)


def run_in_child(fn: Callable[[], object], kill_at: KillPoint | KillAfter | None = None,
                 timeout: float = 120.0) -> ChildResult:
    """Run ``fn`` in a forked child; SIGKILL it at ``kill_at`` (a point, or a delay after one).
    Returns once the child is reaped."""
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        # Nothing the parent allocated is finalised here: a c10d store or group left in a garbage
        # cycle (an in-process agent's) would be destroyed by the child's collector, whose
        # server thread is not in this process -- std::terminate. They are the parent's to free.
        gc.freeze()
        os.close(report_r)
        _child_main(fn, kill_at, report_w)
    os.close(report_w)
    try:
        message = _read_until_exit(report_r, pid, timeout)
        if message == b"S" and isinstance(kill_at, KillAfter):  # the clock starts now; kill unless it finishes
            message = _read_until_exit(report_r, pid, kill_at.seconds, on_timeout=b"K")
        killed = message == b"K"
        if killed:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    except BaseException:
        _kill_and_reap(pid)
        raise
    finally:
        os.close(report_r)
    value = pickle.loads(message[1:]) if message[:1] == b"V" else None
    if message[:1] == b"E":
        raise ChildError(message[1:].decode(errors="replace"))
    return ChildResult(
        killed=killed,
        exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        value=value,
    )


class ChildError(LetoError, RuntimeError):
    """The child raised: its traceback is the message."""


def _child_main(fn: Callable[[], object], kill_at: KillPoint | KillAfter | None, report_w: int) -> None:
    code = 0
    try:
        # libgomp is not fork-safe: a forked child entering an OpenMP region the parent
        # already used deadlocks. One intra-op thread keeps the child out of OpenMP.
        import torch

        torch.set_num_threads(1)
        if isinstance(kill_at, KillAfter):
            set_hook(_StartHook(kill_at.start, report_w))
        elif kill_at is not None:
            set_hook(_KillHook(kill_at, report_w))
        value = fn()
        os.write(report_w, b"V" + pickle.dumps(value))
    except BaseException:  # report anything, including SystemExit, to the parent
        import traceback

        os.write(report_w, b"E" + traceback.format_exc().encode())
        code = 1
    finally:
        os._exit(code)


class _KillHook:
    def __init__(self, kill_at: KillPoint, report_w: int) -> None:
        self.kill_at = kill_at
        self.report_w = report_w
        self.count = 0

    def __call__(self, name: str, context: dict) -> None:
        if name != self.kill_at.name:
            return
        self.count += 1
        if self.count == self.kill_at.occurrence:
            os.write(self.report_w, b"K")
            while True:  # wait for the parent's SIGKILL
                time.sleep(60)


class _StartHook:
    """Tells the parent once when ``start`` is reached, then lets the child run on."""

    def __init__(self, start: str, report_w: int) -> None:
        self.start, self.report_w, self.sent = start, report_w, False

    def __call__(self, name: str, context: dict) -> None:
        if name == self.start and not self.sent:
            self.sent = True
            os.write(self.report_w, b"S")


def _read_until_exit(fd: int, pid: int, timeout: float, on_timeout: bytes | None = None) -> bytes:
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            if on_timeout is not None:
                return on_timeout
            raise LetoTimeoutError(f"child {pid} neither finished nor reached its kill point in {timeout} s")
        data = os.read(fd, 1 << 20)
        if not data:
            return b"".join(chunks)
        chunks.append(data)
        if chunks[0][:1] in (b"K", b"S"):
            return chunks[0][:1]


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
