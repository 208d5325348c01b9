"""Trainer processes the agent starts: environment, output streaming, stopping by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from ..env import Role
from .template_server import die_with_parent
from .warm_template import ForkedProcess, WarmTemplate

TAIL_LINES = 20  # the last lines of a trainer's output the agent keeps, to say why it failed


@dataclass
class TrainerProcess:
    rank: int
    local_rank: int
    role: Role
    generation: int
    shadow_set: str  # "<generation>-<replacement>" of a shadow's set ("" for an active trainer's start)
    popen: subprocess.Popen | ForkedProcess
    started_at: float = field(default_factory=time.time)
    _pump: threading.Thread | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, so a stopped process dies too) and reap."""
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kernel-stuck process
            pass
        if self._pump is not None:
            self._pump.join(timeout=5)

    def last_line(self) -> str:
        """The last non-empty line the trainer printed (after it ended: e.g. its exception)."""
        if self._pump is not None and self.poll() is not None:
            self._pump.join(timeout=1)  # the pipe drains once the process is gone
        return next((line for line in reversed(self.tail) if line.strip()), "").strip()

    def exit_status(self) -> tuple[int | None, int | None]:
        """(exit code, signal) once the process ended."""
        code = self.popen.returncode
        if code is None:
            return None, None
        return (code, None) if code >= 0 else (None, -code)


def spawn(cmd: list[str], env: dict[str, str], rank: int, local_rank: int, role: Role, generation: int,
          shadow_set: str, out: TextIO | None = None, template: WarmTemplate | None = None) -> TrainerProcess:
    """Start one trainer -- forked from the node's warm ``template`` when it is ready, else a new
    interpreter running ``cmd``; its output goes to ``out`` (default stdout) with a rank prefix."""
    popen: subprocess.Popen | ForkedProcess | None = template.fork(cmd[1:], env) if template is not None else None
    if popen is None:
        popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, bufsize=1, text=True, errors="replace",
                                 preexec_fn=die_with_parent)  # trainers never outlive the agent
    proc = TrainerProcess(rank, local_rank, role, generation, shadow_set, popen)
    prefix = f"[rank {rank} {role.value} g{generation}] "
    proc._pump = threading.Thread(target=_pump, args=(popen.stdout, prefix, out or sys.stdout, proc.tail), daemon=True)
    proc._pump.start()
    return proc


def _pump(stream, prefix: str, out, tail: deque) -> None:
    for line in stream:
        tail.append(line)
        out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
        out.flush()
    stream.close()
