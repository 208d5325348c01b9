"""Where a job's control-plane secret comes from (docs/security.md).

- A single-node job makes a fresh random secret per launch; its trainers get it through
  ``LETO_AUTH_KEY``, set in their environment only (``/proc/<pid>/environ`` is readable by the
  owner alone).
- A multi-node job (several ``leto launch`` agents, or the per-rank agents of torchrun/srun)
  needs the same secret on every node. Given with ``--secret-file PATH`` (or ``LETO_SECRET_FILE``;
  the file must be readable by its owner only) or ``LETO_SECRET`` (at least 16 characters, e.g.
  ``openssl rand -hex 32``), fresh per job. Without either, node 0's agent writes a fresh one to
  ``RUN_DIR/job.secret`` (0600) and the others read it there: that needs the run dir on a
  filesystem every node sees (always true for the ranks of one machine).
- Node 0 publishes the secret's fingerprint (an HMAC of a constant: it reveals nothing); a node
  whose secret does not match stops with an error that says which secret to give: at once when
  the secret was given, after a short grace when it is read from a shared run dir.
- **Messages sign with a key of this launch, not with the secret** (``job_key``): node 0 draws a
  random nonce per launch and publishes it (authenticated with the secret); every agent and
  trainer signs with ``HMAC(secret, nonce)``. A secret shared by two jobs (the same
  ``LETO_SECRET`` exported for both) then still gives each its own key: a value captured in one
  job and written into the other is rejected as forged. Node 0 uses the nonce it drew, never one
  read back: a replayed nonce can at worst make another node disagree with node 0 -- the job then
  fails to start, it never accepts another job's messages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..env import AUTH_KEY
from ..env import SECRET as SECRET_ENV
from ..env import SECRET_FILE as SECRET_FILE_ENV
from ..errors import ConfigurationError, LetoTimeoutError

if TYPE_CHECKING:  # only for the annotation: this module itself needs no torch
    import torch.distributed as dist

SHARED_FILE_GRACE_S = 10.0  # how long node 0's RUN_DIR/job.secret may take to appear on a shared filesystem
CHILD_ENV = AUTH_KEY  # what the agent gives its trainers (hex)
SECRET_FILE = "job.secret"
FINGERPRINT_KEY = "auth/fingerprint"
MIN_SECRET = 16


def fingerprint(secret: bytes) -> str:
    return hmac.new(secret, b"leto job secret fingerprint", hashlib.sha256).hexdigest()[:32]


def user_secret(secret_file: str | None, env: Mapping[str, str] = os.environ) -> bytes | None:
    """The secret the user gave (``--secret-file``, ``LETO_SECRET_FILE``, ``LETO_SECRET``), else None."""
    path = secret_file or env.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path)
    text = env.get(SECRET_ENV)
    if text is None:
        return None
    if len(text) < MIN_SECRET:
        raise ConfigurationError(f"{SECRET_ENV} has {len(text)} characters: give at least {MIN_SECRET} random ones "
                                 "(e.g. `export LETO_SECRET=$(openssl rand -hex 32)`)")
    return text.encode()


def read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigurationError(f"secret file {path!r}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigurationError(f"secret file {path!r} must belong to you and be readable by you alone: "
                                     f"`chmod 600 {path}`")
        secret = f.read().strip()
    if len(secret) < MIN_SECRET:
        raise ConfigurationError(f"secret file {path!r} holds {len(secret)} bytes: give at least {MIN_SECRET}")
    return secret


def write_secret_file(run_dir: str, secret: bytes) -> str:
    """``RUN_DIR/job.secret`` (0600), replaced atomically (a reader never sees half of it)."""
    path = os.path.join(run_dir, SECRET_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def job_secret(store: dist.Store, node_rank: int, nnodes: int, run_dir: str, secret_file: str | None,
               timeout: float, check_stop: Callable[[], None] = lambda: None) -> bytes:
    """This agent's secret for the job (module doc); ``store`` is the raw (unsigned) store."""
    given = user_secret(secret_file)
    if nnodes == 1:
        return given or secrets.token_hex(32).encode()
    if node_rank == 0:
        secret = given or secrets.token_hex(32).encode()
        if given is None:
            write_secret_file(run_dir, secret)
        store.set(FINGERPRINT_KEY, fingerprint(secret))
        return secret
    deadline = time.monotonic() + timeout
    published_at: float | None = None
    while True:
        check_stop()
        if store.check([FINGERPRINT_KEY]):
            wanted = store.get(FINGERPRINT_KEY).decode(errors="replace")
            found = given if given is not None else _shared_file_secret(run_dir)
            if found is not None and hmac.compare_digest(fingerprint(found), wanted):
                return found
            # Node 0 has published: a given secret cannot change any more, and a shared run dir
            # shows node 0's file within a few seconds -- no reason to wait for the start-up timeout.
            if published_at is None:
                published_at = time.monotonic()
                deadline = min(deadline, published_at + (0.0 if given is not None else SHARED_FILE_GRACE_S))
        if time.monotonic() > deadline:
            how = ("its LETO_SECRET / --secret-file differs from node 0's" if given is not None else
                   f"no matching {SECRET_FILE} in {run_dir} (node 0 writes it there)")
            raise LetoTimeoutError(
                f"node {node_rank} did not get the job's secret: {how}. Give every node's "
                f"`leto launch` the same fresh secret ({SECRET_ENV} or --secret-file), or a run dir on a filesystem "
                "all nodes share")
        time.sleep(0.1)


NONCE_KEY = "auth/launch"  # node 0's nonce of this launch, with its HMAC under the secret


def _nonce_tag(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, b"leto launch nonce\0" + nonce.encode(), hashlib.sha256).hexdigest()


def derive_job_key(secret: bytes, nonce: str) -> bytes:
    """The key this launch signs its control messages with (hex bytes, like a secret)."""
    return hmac.new(secret, b"leto job key\0" + nonce.encode(), hashlib.sha256).hexdigest().encode()


def job_key(store: dist.Store, node_rank: int, secret: bytes, timeout: float,
            check_stop: Callable[[], None] = lambda: None) -> bytes:
    """This launch's signing key (module doc): node 0 draws and publishes the nonce, the other
    nodes wait for a value authentic under the secret. ``store`` is the raw store."""
    if node_rank == 0:
        nonce = secrets.token_hex(16)
        store.set(NONCE_KEY, f"{nonce}.{_nonce_tag(secret, nonce)}")
        return derive_job_key(secret, nonce)
    deadline = time.monotonic() + timeout
    while True:
        check_stop()
        if store.check([NONCE_KEY]):
            nonce, _, tag = store.get(NONCE_KEY).decode(errors="replace").partition(".")
            if hmac.compare_digest(tag, _nonce_tag(secret, nonce)):
                return derive_job_key(secret, nonce)
        if time.monotonic() > deadline:
            raise LetoTimeoutError(f"node {node_rank} got no launch nonce from node 0 within {timeout:.0f} s (the "
                                   "job's store holds none authentic under the job's secret)")
        time.sleep(0.1)


def _shared_file_secret(run_dir: str) -> bytes | None:
    try:
        return read_secret_file(os.path.join(run_dir, SECRET_FILE))
    except ConfigurationError:
        return None
