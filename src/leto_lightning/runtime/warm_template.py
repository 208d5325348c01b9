"""The agent's side of the warm template (``template_server.py`` says what it is and why).

``WarmTemplate.start`` launches the node's template and returns at once: its imports overlap
the first trainers' start. ``fork`` asks it for a trainer once it is ready and returns a
``ForkedProcess`` -- the same face as ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
``returncode``, a text ``stdout``) -- or None when the template is not ready (yet) or cannot
fork: the caller then starts the trainer the usual way. The agent is made a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so the trainers the template forks are the agent's own children:
it waits for them, and they die with it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 10.0


def become_subreaper() -> bool:
    """Orphans below this process are re-parented to it (Linux ``PR_SET_CHILD_SUBREAPER``)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


class ForkedProcess:
    """A trainer the template forked, now a child of this process (``subprocess.Popen``'s face)."""

    def __init__(self, pid: int, stdout: IO[str]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


@dataclass
class TemplateStatus:
    """What the template said once its imports were done."""

    ready: bool
    reason: str | None = None
    import_s: float = 0.0
    modules: int = 0


class WarmTemplate:
    """One node's template process (module doc)."""

    def __init__(self, popen: subprocess.Popen, sock: socket.socket) -> None:
        self.popen = popen
        self.sock = sock
        self.status: TemplateStatus | None = None  # None until the template reported

    @classmethod
    def start(cls, python: str, script: str, env: Mapping[str, str]) -> WarmTemplate | None:
        if not become_subreaper():
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [python, "-m", "leto_lightning.runtime.template_server", "--fd", str(theirs.fileno()),
               "--agent", str(os.getpid()), script]
        popen = subprocess.Popen(cmd, env=dict(env), pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=sys.stderr)
        theirs.close()
        return cls(popen, ours)

    def check(self) -> TemplateStatus | None:
        """The template's report once it is in (without waiting); None while it still imports."""
        exited = self.popen.poll() is not None  # before looking: what it sent before exiting is in the socket
        if self.status is None and select.select([self.sock], [], [], 0)[0]:
            said = json.loads(self.sock.recv(1 << 16) or b'{"ready": false, "reason": "it closed its socket"}')
            self.status = TemplateStatus(said["ready"], said.get("reason"), said.get("import_s", 0.0),
                                         said.get("modules", 0))
        if self.status is None and exited:
            self.status = TemplateStatus(False, f"the template exited ({self.popen.returncode})")
        return self.status

    def fork(self, argv: list[str], env: Mapping[str, str]) -> ForkedProcess | None:
        """A trainer running ``python argv...`` with ``env``, forked from the template; None when
        the template is not ready or does not answer (the caller starts one the usual way)."""
        status = self.check()
        if status is None or not status.ready or self.popen.poll() is not None:
            return None
        read_end, write_end = os.pipe()
        try:
            request = json.dumps({"argv": argv, "env": dict(env), "cwd": os.getcwd()}).encode()
            socket.send_fds(self.sock, [request], [write_end])
        except OSError as exc:
            os.close(read_end)
            self._broken(f"the request failed: {exc}")
            return None
        finally:
            os.close(write_end)
        if not select.select([self.sock], [], [], REPLY_TIMEOUT_S)[0]:
            os.close(read_end)
            self._broken(f"no answer within {REPLY_TIMEOUT_S:.0f} s")
            return None
        reply = json.loads(self.sock.recv(1 << 16) or b'{"error": "it closed its socket"}')
        if "pid" not in reply:
            os.close(read_end)
            self._broken(reply.get("error", "no pid"))
            return None
        return ForkedProcess(reply["pid"], os.fdopen(read_end, "r", buffering=1, errors="replace"))

    def _broken(self, reason: str) -> None:
        log.warning("warm template: %s; trainers start the usual way from now on", reason)
        self.status = TemplateStatus(False, reason)

    def close(self) -> None:
        """End the template (its socket closed, then SIGKILL if it lingers) and reap it."""
        self.sock.close()
        try:
            self.popen.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
