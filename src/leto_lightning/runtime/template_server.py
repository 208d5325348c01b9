"""The warm template: a process that has imported what the user's script imports, and forks
trainers from there (``python -m leto_lightning.runtime.template_server --fd N SCRIPT``).

A fresh trainer pays for its imports (torch, Lightning, Accelerate, the script's own modules:
seconds) before it can do anything; a shadow started after a promotion is not ready for that
long, and a second failure inside that window is a cold start. The agent keeps one template per
node: started once per job with the trainers' common environment, it imports every module the
script names (top-level ``import`` statements and those in function bodies -- never the script's
own code), touches no device and no process group, then waits. For each trainer the agent sends
its argv, environment and working directory with the write end of its output pipe
(``SCM_RIGHTS`` over a ``SOCK_SEQPACKET`` socket pair); the template forks twice, so the trainer
is re-parented to the agent (a child subreaper, ``warm_template.py``), which waits for it, kills
it and reads its output exactly as it does a ``subprocess.Popen`` child. The trainer then runs
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


def serve(sock: socket.socket, script: str, agent: int) -> Callable[[], None] | None:
    """Answer the agent's requests until it closes the socket (returns None: the template ends);
    in a forked trainer, return the function that runs the script."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 1)
        except OSError:
            return None
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        request = json.loads(data)
        run = _fork_trainer(sock, request, fds[0], agent)
        if run is not None:
            return run


def _fork_trainer(sock: socket.socket, request: dict, out_fd: int, agent: int) -> Callable[[], None] | None:
    """Fork twice: the intermediate child reports the trainer's pid and exits, so the trainer is
    re-parented to the agent; the template reaps the intermediate and answers."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        trainer = os.fork()
        if trainer == 0:
            os.close(w)
            return _become_trainer(sock, request, out_fd, agent)
        os.write(w, str(trainer).encode())
        os._exit(0)
    os.close(w)
    os.close(out_fd)
    with os.fdopen(r, "rb") as pipe:
        pid = pipe.read().decode()
    os.waitpid(middle, 0)
    sock.send(json.dumps({"pid": int(pid)} if pid else {"error": "the fork failed"}).encode())
    return None


def _become_trainer(sock: socket.socket, request: dict, out_fd: int, agent: int) -> Callable[[], None]:
    sock.close()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    deadline = time.monotonic() + 10
    while os.getppid() != agent:  # the intermediate's exit re-parents this process to the agent
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.001)
    _die_with_agent(agent)
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


def _die_with_agent(agent: int) -> None:
    """SIGKILL this trainer when the agent dies (PR_SET_PDEATHSIG), as a ``Popen`` child's."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != agent:  # the agent died before the signal was armed
        os._exit(70)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="leto-template", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="the agent's end of the socket pair")
    parser.add_argument("--agent", type=int, required=True, help="the agent's pid (the trainers' parent)")
    parser.add_argument("script")
    args = parser.parse_args(argv)
    _die_with_agent(args.agent)
    sock = socket.socket(fileno=args.fd)
    t0 = time.monotonic()
    done, failed = warm_up(args.script)
    hazard = fork_hazard()
    sock.send(json.dumps({"ready": hazard is None, "reason": hazard, "import_s": round(time.monotonic() - t0, 3),
                          "modules": len(done), "failed": failed}).encode())
    if hazard is not None:
        return
    run = serve(sock, args.script, args.agent)
    if run is not None:
        run()  # the trainer: the script as __main__; the interpreter's normal exit follows


if __name__ == "__main__":
    main()
