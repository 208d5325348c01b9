"""A run directory belongs to one live job and to its owner alone.

``claim`` is what the agent of ``leto launch`` does before it writes anything there:

- the directory is created with ``mode`` (default 0700: only the owner may read weights,
  optimizer state, RNG, the store's port and the pids) and an existing one is narrowed to it;
  a mode that lets the group or others write is refused (they could plant files and links);
- a directory owned by another user is refused -- whoever controls it could plant checkpoints;
  so is an entry inside it that is not the user's own (left there while it was writable to
  others), and a symbolic link in place of a file or directory Leto uses (``LETO_ENTRIES``);
- the process umask becomes the complement of ``mode`` for the agent and every trainer it
  starts, so their files are 0600 (0640 with ``--run-dir-mode 0750``, ...);
- an exclusive ``flock`` on ``agent.lock`` says the directory has a live job. The kernel drops
  the lock when its holder dies however it dies, so a lock left by a SIGKILLed agent is free to
  take: the file still names the dead agent, and the new owner reports it took over.

A second ``leto launch`` into a directory with a live job is refused with the live agent's pid.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass

from ..errors import ConfigurationError
from .storage import PlantedLinkError, open_run_dir_file, run_dir_path

LOCK_FILE = "agent.lock"
DEFAULT_MODE = 0o700
# What Leto itself reads and writes in a run dir (agent.node<n>.lock too): never a link.
LETO_ENTRIES = ("events.jsonl", "checkpoints", "agents", "accelerate", "job.secret", "recipe.yaml", LOCK_FILE)
logger = logging.getLogger(__name__)


class RunDirBusy(ConfigurationError):
    """Another live job (its agent's pid in the message) holds the run directory."""


@dataclass
class RunDirClaim:
    """The held lock of one agent on one run directory (``release`` at the end of the job)."""

    path: str
    fd: int
    previous: dict | None  # what a lock file left by a dead agent said (None: no such file)
    old_umask: int

    def release(self) -> None:
        if self.fd < 0:
            return
        try:  # unlink while still holding the lock: nobody can take a lock on the old inode meanwhile
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1
        os.umask(self.old_umask)


def parse_mode(text: str) -> int:
    """``"0750"`` -> 0o750; the owner must keep rwx (the agent writes there)."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise ConfigurationError(f"--run-dir-mode {text!r}: expected an octal mode such as 0700 or 0750") from None
    check_mode(mode, repr(text))
    return mode


def check_mode(mode: int, shown: str | None = None) -> None:
    """The owner keeps rwx; nobody else may write (they could plant files and links)."""
    shown = shown or f"'{mode:04o}'"
    if mode & ~0o777 or mode & 0o700 != 0o700:
        raise ConfigurationError(f"--run-dir-mode {shown}: the owner needs rwx (0700 ... 0755 without special bits)")
    if mode & 0o022:
        raise ConfigurationError(f"--run-dir-mode {shown} lets the group or others write the run dir (they could plant "
                                 "checkpoints and links there): use 0700 (the default), or 0750 to let your group "
                                 "read it")


def mode_argument(text: str) -> int:
    """``parse_mode`` for argparse: the reason reaches the user (argparse hides a ValueError's)."""
    import argparse

    try:
        return parse_mode(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def prepare(path: str, mode: int = DEFAULT_MODE) -> None:
    """Create ``path`` (and missing parents) with ``mode``; narrow an existing one of ours to it."""
    check_mode(mode)
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
        st = os.stat(path)
    except FileExistsError:
        raise ConfigurationError(f"run dir {path!r} exists and is not a directory: pick another --run-dir") from None
    except OSError as exc:  # permission, a file on the way (NotADirectoryError), read-only, name too long ...
        raise ConfigurationError(f"run dir {path!r} cannot be created ({exc.strerror or exc}): pick a writable "
                                 "--run-dir") from None
    if st.st_uid != os.geteuid():
        raise ConfigurationError(
            f"run dir {path!r} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): whoever owns it could "
            "plant checkpoints there -- use a run dir of your own")
    if st.st_mode & 0o777 != mode:
        os.chmod(path, mode)


def lock_name(node_rank: int) -> str:
    """Node 0's agent holds ``agent.lock``; node n's ``agent.node<n>.lock`` (a run dir several
    nodes share is one job's)."""
    return LOCK_FILE if node_rank == 0 else f"agent.node{node_rank}.lock"


def claim(run_dir: str, mode: int = DEFAULT_MODE, lock_dir: str | None = None, node_rank: int = 0) -> RunDirClaim:
    """Prepare ``run_dir`` (and ``lock_dir`` inside it, where this agent's events go) and take the
    job lock there; raises ``RunDirBusy`` naming the live holder."""
    check_mode(mode)
    old_umask = os.umask(0o777 & ~mode)  # 0700 -> umask 077: files 0600, directories 0700
    try:
        prepare(run_dir, mode)
        check_entries(run_dir)
        lock_dir = lock_dir or run_dir
        below = os.path.relpath(os.path.abspath(lock_dir), os.path.abspath(run_dir))
        if below != "." and not below.startswith(".."):  # agents/rank<n>: no link on the way
            run_dir_path(run_dir, *below.split(os.sep), directory=True)
        elif below != ".":
            prepare(lock_dir, mode)
        name = lock_name(node_rank)
        fd = _lock(lock_dir, name)
    except BaseException:
        os.umask(old_umask)
        raise
    previous = _read(fd) or None
    _write(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    if previous:
        logger.warning("run dir %s: took over the lock of agent pid %s (no longer running)", run_dir,
                       previous.get("pid"))
    return RunDirClaim(os.path.join(lock_dir, name), fd, previous, old_umask)


def check_entries(run_dir: str) -> None:
    """Refuse what a job must not trust in ``run_dir`` (without following any link): an entry that
    belongs to another user anywhere in its tree (root's are trusted: root can do anything
    anyway), a link in place of one of ``LETO_ENTRIES``."""
    me = os.geteuid()
    for top, dirs, files in os.walk(run_dir, onerror=lambda _exc: None):  # links are listed, not followed
        for name in dirs + files:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # removed meanwhile (another rank's agent, a finishing job)
                continue
            if top == run_dir and stat.S_ISLNK(st.st_mode) and (name in LETO_ENTRIES or name.endswith(".lock")):
                run_dir_path(run_dir, name)  # raises, naming the link and the fix
            if st.st_uid not in (me, 0):
                raise PlantedLinkError(
                    f"{path} in the run dir belongs to uid {st.st_uid}, not to you (uid {me}): whoever owns it can "
                    "change what the job reads or writes -- remove it, or pick another --run-dir")


def _lock(path: str, name: str) -> int:
    """An fd holding the exclusive lock of ``path/name`` (the file at that path, not an
    unlinked one a finishing agent released)."""
    lock_path = os.path.join(path, name)
    while True:
        try:  # not through a link, only a plain file of ours (else PlantedLinkError)
            fd = open_run_dir_file(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigurationError(f"run dir {path!r}: cannot open {name} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise RunDirBusy(
                f"run dir {path!r} belongs to a live job: its agent is pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (started {_when(holder)}) -- wait for it to end, stop it, or pick "
                "another --run-dir") from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder released (unlinked) it between our open and our lock: again


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


def _write(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fchmod(fd, 0o600)


def _when(holder: dict) -> str:
    started = holder.get("started")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "at an unknown time"
