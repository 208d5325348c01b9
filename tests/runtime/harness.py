"""Run ``leto launch`` as a real subprocess and read what it left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leto_lightning.examples import PLAIN_DDP
from leto_lightning.runtime.events import read_events
from leto_lightning.runtime.procs import is_alive


@dataclass
class LaunchResult:
    returncode: int
    output: str
    run_dir: Path
    events: list[dict]

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    def final_state(self, rank: int) -> dict:
        return torch.load(self.run_dir / f"final_rank{rank}.pt", weights_only=False)

    def losses(self, rank: int) -> dict[int, float]:
        """Loss per iteration; a recomputed iteration keeps its last value."""
        out = {}
        for line in open(self.run_dir / f"loss_rank{rank}.jsonl"):
            rec = json.loads(line)
            out[rec["it"]] = rec["loss"]
        return out


def launch_args(run_dir: Path, iterations: int, faults=(), extra=(), script_args=(), nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
            "--faults", json.dumps(list(faults)), *extra, PLAIN_DDP, "--iterations", str(iterations), *script_args]


def start(run_dir: Path, iterations: int, **kw) -> subprocess.Popen:
    return subprocess.Popen(launch_args(run_dir, iterations, **kw), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> LaunchResult:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"leto launch did not finish in {timeout} s:\n{out[-4000:]}")
    result = LaunchResult(proc.returncode, out, run_dir, read_events(run_dir))
    assert_nothing_left(result)
    return result


def stop(proc: subprocess.Popen) -> None:
    """End a launcher whose test failed: SIGTERM first, so the agent frees what it allocated."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def run(run_dir: Path, iterations: int, **kw) -> LaunchResult:
    return finish(start(run_dir, iterations, **kw), run_dir)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_nothing_left(result: LaunchResult) -> None:
    """Every process the job started is gone, and the store's port is closed."""
    pids = [e["pid"] for e in result.events if e["event"] in ("process_started", "job_started")]
    alive = [p for p in pids if is_alive(p)]
    assert not alive, f"processes left running: {alive}"
    ports = [e["port"] for e in result.of("job_started")]
    listening = _listening_ports()
    assert not set(ports) & listening, f"port still listening: {set(ports) & listening}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def _listening_ports() -> set[int]:
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


def same_state(a: dict, b: dict) -> list[str]:
    diffs = [f"param {i}" for i, (x, y) in enumerate(zip(a["params"], b["params"])) if not torch.equal(x, y)]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    diffs += [f"state {i}.{k}" for i in sb for k in sb[i] if not torch.equal(sa[i][k], sb[i][k])]
    return diffs
