"""The agent's side of the warm template (``template_server.py`` says what it is and why).

``WarmTemplate.start`` launches the node's template and returns at once: its imports overlap
the first trainers' start. ``fork`` asks it for a trainer once it is ready and returns a
``ForkedProcess`` -- the same face as ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
``returncode``, a text ``stdout``) -- or None when the template is not ready (yet) or cannot
fork: the caller then starts the trainer the usual way. A forked trainer is the template's
child: the template reaps it and sends its exit status, which ``poll`` reads without waiting.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from .procs_state import is_alive

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 10.0


class ForkedProcess:
    """A trainer the template forked (``subprocess.Popen``'s face); its exit status comes from
    the template."""

    def __init__(self, pid: int, stdout: IO[str], template: WarmTemplate) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._template = template

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid)
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
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: the signal), as the template reaped it
        self._replies: list[dict] = []  # answers to fork requests, in order

    @classmethod
    def start(cls, python: str, script: str, env: Mapping[str, str]) -> WarmTemplate:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [python, "-m", "leto_lightning.runtime.template_server", "--fd", str(theirs.fileno()),
               "--agent", str(os.getpid()), script]
        popen = subprocess.Popen(cmd, env=dict(env), pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL)  # stderr: the agent's own fd 2
        theirs.close()
        return cls(popen, ours)

    def _drain(self, timeout: float = 0.0) -> None:
        """Read what the template sent (waiting up to ``timeout`` for the first message)."""
        while select.select([self.sock], [], [], timeout)[0]:
            timeout = 0.0
            try:
                raw = self.sock.recv(1 << 16)
            except OSError:
                raw = b""
            if not raw:  # it closed its socket: it is gone
                self._gone()
                return
            said = json.loads(raw)
            if "exited" in said:
                self._exits[int(said["exited"])] = int(said["code"])
            elif "ready" in said:
                self.status = TemplateStatus(said["ready"], said.get("reason"), said.get("import_s", 0.0),
                                             said.get("modules", 0))
            else:
                self._replies.append(said)

    def _gone(self) -> None:
        if self.status is None or self.status.ready:
            self.status = TemplateStatus(False, f"the template exited ({self.popen.poll()})")

    def check(self) -> TemplateStatus | None:
        """The template's report once it is in (without waiting); None while it still imports."""
        exited = self.popen.poll() is not None  # before reading: what it sent before exiting is in the socket
        self._drain()
        if self.status is None and exited:
            self._gone()
        return self.status

    def exit_code(self, pid: int) -> int | None:
        """The exit code of trainer ``pid`` once the template reaped it; a trainer of a template
        that is gone died with it (SIGKILL)."""
        self._drain()
        if pid in self._exits:
            return self._exits[pid]
        if self.popen.poll() is not None and not is_alive(pid):
            return -signal.SIGKILL
        return None

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
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self._replies and time.monotonic() < deadline and self.status is not None and self.status.ready:
            self._drain(timeout=max(0.0, deadline - time.monotonic()))
        if not self._replies:
            os.close(read_end)
            self._broken(f"no answer within {REPLY_TIMEOUT_S:.0f} s")
            return None
        reply = self._replies.pop(0)
        return ForkedProcess(int(reply["pid"]), os.fdopen(read_end, "r", buffering=1, errors="replace"), self)

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
