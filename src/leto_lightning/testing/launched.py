"""A ``leto launch`` job run as a real subprocess, and what it left behind.

For tests and benchmarks that check recovery end to end: start the launcher, wait for a
condition (``wait_for``), end it (``finish``, or ``stop`` when the caller failed first), then
read its events and the per-rank final states the example scripts save, and check that no
process it started is still alive and its store's port is closed (``leftovers``).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.events import read_events
from ..runtime.procs_state import is_alive


@dataclass
class LaunchedRun:
    """A finished launcher: exit status, its output, its run directory and event log."""

    returncode: int
    output: str
    run_dir: Path
    events: list[dict]

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    def final(self, rank: int) -> dict:
        """The state the example scripts save at the end: ``final_rank<r>.pt``."""
        return torch.load(self.run_dir / f"final_rank{rank}.pt", weights_only=True)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300, result: type = LaunchedRun) -> LaunchedRun:
    """Wait for the launcher (SIGTERM after ``timeout``: it then frees what it allocated),
    read what it left, and raise ``AssertionError`` if a process or port outlived it."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"leto launch did not finish in {timeout} s:\n{out[-5000:]}") from None
    run = result(proc.returncode, out, run_dir, read_events(run_dir))
    left = leftovers(run)
    if left:
        raise AssertionError("; ".join(left))
    return run


def stop(proc: subprocess.Popen) -> None:
    """End a launcher whose caller failed: SIGTERM first, so the agent frees its memory."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def leftovers(run: LaunchedRun) -> list[str]:
    """What outlived the job: processes it started, the port its store listened on."""
    pids = [e["pid"] for e in run.events if e["event"] in ("process_started", "job_started")]
    alive = [p for p in pids if is_alive(p)]
    ports = {e["port"] for e in run.of("job_started") if e.get("port")} & listening_ports()
    return ([f"processes left running: {alive}"] if alive else []) + (
        [f"port still listening: {sorted(ports)}"] if ports else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this machine (``/proc/net/tcp*``)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
