"""The warm template: a process that has imported what the user's script imports, and forks
trainers from there (``python -m leto_lightning.runtime.template_server --fd N SCRIPT``).

A fresh trainer pays for its imports (torch, Lightning, Accelerate, the script's own modules:
seconds) before it can do anything; a shadow started after a promotion is not ready for that
long, and a second failure inside that window is a cold start. The agent keeps one template per
node: started once per job with the trainers' common environment, it imports every module the
script names (top-level ``import`` statements and those in function bodies -- never the script's
own code), touches no device and no process group, then waits. For each trainer the agent sends
its argv, environment and working directory with the write end of its output pipe
(``SCM_RIGHTS`` over a ``SOCK_SEQPACKET`` socket pair); the template forks the trainer, answers
with its pid and reports its exit status when it ends, so the agent (``warm_template.py``) waits
for it, kills it and reads its output as it does a ``subprocess.Popen`` child's; a trainer dies
with the template, the template with the agent. The trainer then runs
the script as ``python SCRIPT ARGS`` would: ``__main__``, ``sys.argv``, ``sys.path[0]``, its own
environment; the interpreter's normal exit (atexit, non-daemon threads, exit status).

Forking is refused -- the agent starts trainers as before, saying why once -- when the template
is not safe to fork: a Python thread running after the imports, or CUDA initialised by one of
them. (Native threads torch starts at import are idle; DataLoader workers fork past them too.)
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

MAX_REQUEST = 1 << 20  # an argv and an environment: far below


def imported_modules(script: str) -> list[str]:
    """The absolute module names ``script`` imports anywhere (its own code is never run)."""
    with open(script, "rb") as f:
        tree = ast.parse(f.read(), filename=script)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return list(dict.fromkeys(names))


def warm_up(script: str) -> tuple[list[str], list[str]]:
    """Import what ``script`` imports; (imported, failed). A module that fails to import here
    fails in the trainer too, where the user sees the error."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    done, failed = [], []
    for name in imported_modules(script):
        try:
            importlib.import_module(name)
            done.append(name)
        except BaseException:
            failed.append(name)
    return done, failed


def fork_hazard() -> str | None:
    """Why forking this process would be unsafe, or None."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"a Python thread runs after the script's imports ({', '.join(others)})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised by one of the script's imports"
    return None


class _Server:
    """The template's loop: requests from the agent, and its trainers' exits (``SIGCHLD`` wakes
    it through a pipe), each reported to the agent over the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so the wakeup fd is written
        signal.set_wakeup_fd(self.wake_w)

    def run(self) -> Callable[[], None] | None:
        """Serve until the agent closes the socket (None: the template ends); in a forked
        trainer, return the function that runs the script."""
        while True:
            readable = select.select([self.sock.fileno(), self.wake_r], [], [], 1.0)[0]
            if self.wake_r in readable:
                os.read(self.wake_r, 4096)
            self._report_exits()
            if self.sock.fileno() not in readable:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MAX_REQUEST, 1)
            except OSError:
                return None
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            run = self._fork_trainer(json.loads(data), fds[0])
            if run is not None:
                return run

    def _report_exits(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())

    def _fork_trainer(self, request: dict, out_fd: int) -> Callable[[], None] | None:
        sys.stdout.flush()
        sys.stderr.flush()
        template = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            return _become_trainer(self.sock, request, out_fd, template)
        os.close(out_fd)
        self.sock.send(json.dumps({"pid": pid}).encode())
        return None


def _become_trainer(sock: socket.socket, request: dict, out_fd: int, template: int) -> Callable[[], None]:
    sock.close()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    die_with_parent(template)  # the template dies with the agent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _fresh_global_rngs()
    argv = request["argv"]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))

    def run() -> None:
        import runpy

        runpy.run_path(argv[0], run_name="__main__")

    return run


def _fresh_global_rngs() -> None:
    """Seed what a fresh interpreter seeds from the OS at import (Python's ``random``, NumPy's
    global generator), so forked trainers do not share the template's streams. torch's default
    generator starts from a fixed seed in every interpreter: nothing to do."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``):
    a trainer the agent starts (before exec), the template, a trainer forked from the template.
    ``parent``: the pid it must still have once armed (else it died first: exit at once)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # pragma: no cover - not Linux: the agent's own cleanup still applies
        return
    if parent is not None and os.getppid() != parent:
        os._exit(70)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="leto-template", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="the agent's end of the socket pair")
    parser.add_argument("--agent", type=int, required=True, help="the agent's pid (the template dies with it)")
    parser.add_argument("script")
    args = parser.parse_args(argv)
    # a Ctrl-C or SLURM's SIGINT to the job's process group is the agent's to handle (it closes
    # the template): no KeyboardInterrupt traceback from here. Trainers get the default back.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(args.agent)
    sock = socket.socket(fileno=args.fd)
    t0 = time.monotonic()
    done, failed = warm_up(args.script)
    hazard = fork_hazard()
    sock.send(json.dumps({"ready": hazard is None, "reason": hazard, "import_s": round(time.monotonic() - t0, 3),
                          "modules": len(done), "failed": failed}).encode())
    if hazard is not None:
        return
    run = _Server(sock).run()
    if run is not None:
        run()  # the trainer: the script as __main__; the interpreter's normal exit follows


if __name__ == "__main__":
    main()
