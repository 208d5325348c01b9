"""The job's control plane: a TCPStore nobody without the job's secret can steer.

Every value the agents and trainers exchange through ``runtime/keys.py`` (promote, finished,
job id, failure verdicts, recovery lockstep, heartbeats, ...) is written as::

    <hmac hex>.<writer>.<seq>.<value>     hmac = HMAC-SHA256(secret, context | key | writer | seq | value)

``writer`` is a random id per process and ``seq`` counts that writer's messages, so a reader
rejects a value that was not signed with the secret (forged), that was signed for another key
(copied), or that is older than one it already accepted from the same writer on the same key
(replayed). A rejected value is reported once (``on_reject``) and the reader goes on as if it
were not there: the last accepted value stands, or the key still counts as unset. Nothing of a
rejected value is kept: it is counted (``rejected``) and remembered by a 32-byte digest (at most
``MAX_REMEMBERED`` of them), and a value over ``MAX_MESSAGE`` bytes -- no control message is
near that -- is refused before its MAC is even computed. A flood of large forged values costs
the reader the time to read each once, never memory.

The store itself is hosted on a socket bound to ``--master-addr`` only (127.0.0.1 by default):
a single-node job is not reachable from other hosts. Process groups use ``raw`` -- torch's own
rendezvous and collectives, unauthenticated exactly as under torchrun (docs/security.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch.distributed as dist

from ..errors import ConfigurationError, InternalError, LetoTimeoutError

logger = logging.getLogger(__name__)
POLL_S = 0.05  # how often a wait re-reads a key that holds a rejected value
MAX_MESSAGE = 1 << 20  # bytes: the largest control value accepted (the real ones are under a few KiB)
MAX_REMEMBERED = 4096  # digests of rejected values kept to report each once


def is_store_timeout(exc: BaseException) -> bool:
    """A store operation ran past its deadline -- told by type, not by the message.

    torch (2.x, ``c10/util/Exception.h``) raises ``DistStoreError`` when a store ``wait`` (or a
    ``get``, which waits) times out ("wait timeout after ... ms"); ``DistNetworkError`` when the
    connection is gone (the store's host died: not a timeout, nothing to wait for any more); and
    ``QueueEmptyError``, a ``DistStoreError``, for an empty queue. torch's own elastic agent reads
    ``DistStoreError`` from a wait the same way (``torch/distributed/elastic/utils/store.py``).
    """
    return isinstance(exc, dist.DistStoreError) and not isinstance(exc, dist.QueueEmptyError)


@contextlib.contextmanager
def store_timeouts(what: str) -> Iterator[None]:
    """Inside: a store timeout (``is_store_timeout``) becomes ``LetoTimeoutError`` naming
    ``what``; any other error passes unchanged."""
    try:
        yield
    except dist.DistStoreError as exc:
        if not is_store_timeout(exc):
            raise
        raise LetoTimeoutError(f"{what}: {exc}") from exc


def host_store(addr: str, port: int, timeout: timedelta) -> tuple[dist.TCPStore, int]:
    """A master TCPStore listening on ``addr`` only (torch's own would listen on every interface)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigurationError(f"--master-addr {addr!r} does not resolve ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"cannot host the job's store on {addr}:{port} ({exc.strerror}): --master-addr must be an address of "
            "this machine (node 0) and --master-port a free port (0: any)") from None
    bound = sock.getsockname()[1]
    try:
        store = dist.TCPStore(addr, bound, world_size=None, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach())
    except BaseException:
        sock.close()
        raise
    return store, bound


class SignedStore:
    """A ``dist.Store``-like view of ``raw`` that signs what it writes and checks what it reads."""

    def __init__(self, raw: dist.Store, secret: bytes, context: str = "",
                 on_reject: Callable[[str, str], None] | None = None) -> None:
        if len(secret) < 16:
            raise ConfigurationError("the job's secret must have at least 16 bytes")
        self.raw = raw
        self._keyed = hmac.new(secret, digestmod=hashlib.sha256)  # copied per message: the key set up once
        self._context = context.encode()
        self._writer = secrets.token_hex(4)
        self._seq = 0
        self._on_reject = on_reject
        self._accepted: dict[str, tuple[bytes, bytes]] = {}  # key -> (raw message, value)
        self._latest: dict[tuple[str, str], int] = {}  # (key, writer) -> newest seq accepted
        self._reported: set[bytes] = set()  # digests of (key, rejected message): each reported once
        self.rejected = 0  # rejected values read (each distinct one counted once)

    @property
    def timeout(self) -> timedelta:
        timeout: timedelta = self.raw.timeout  # type: ignore[attr-defined]  # every Store has it; torch's stub lacks it
        return timeout

    # -- signing ---------------------------------------------------------------------------
    def _mac(self, key: str, writer: bytes, seq: bytes, value: bytes) -> bytes:
        mac = self._keyed.copy()
        mac.update(b"\0".join((self._context, key.encode(), writer, seq, value)))
        return mac.hexdigest().encode()

    def sign(self, key: str, value: str | bytes) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._seq += 1
        writer, seq = self._writer.encode(), str(self._seq).encode()
        return b".".join((self._mac(key, writer, seq, value), writer, seq, value))

    def _verify(self, key: str, message: bytes) -> bytes | None:
        """The value of ``message`` if it is authentic and new; else report it, return None."""
        known = self._accepted.get(key)
        if known is not None and known[0] == message:
            return known[1]
        if len(message) > MAX_MESSAGE:
            self._reject(key, message, f"oversize: {len(message)} bytes, no control message is over {MAX_MESSAGE}")
            return None
        parts = message.split(b".", 3)
        if len(parts) != 4 or not parts[2].isdigit() or not hmac.compare_digest(
                parts[0], self._mac(key, parts[1], parts[2], parts[3])):
            self._reject(key, message, "forged: not signed with the job's secret for this key")
            return None
        writer, seq = parts[1].decode(), int(parts[2])
        if seq <= self._latest.get((key, writer), 0):
            self._reject(key, message, f"replayed: an older message of writer {writer} (seq {seq})")
            return None
        self._latest[(key, writer)] = seq
        self._accepted[key] = (message, parts[3])
        return parts[3]

    def _reject(self, key: str, message: bytes, reason: str) -> None:
        digest = hashlib.sha256(key.encode() + b"\0" + message).digest()
        if digest in self._reported:
            return
        if len(self._reported) >= MAX_REMEMBERED:  # a flood: forget (each may be reported again), never grow
            self._reported.clear()
        self._reported.add(digest)
        self.rejected += 1
        logger.warning("control message rejected: key %r: %s", key, reason)
        if self._on_reject is not None:
            self._on_reject(key, reason)

    def _current(self, key: str) -> bytes | None:
        """The authentic value under ``key`` now (the last accepted one if it holds a rejected
        value), None if it has none."""
        if not self.raw.check([key]):
            return None
        value = self._verify(key, self.raw.get(key))
        if value is None and key in self._accepted:
            return self._accepted[key][1]
        return value

    # -- the Store API the runtime uses -------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        message = self.sign(key, value)
        self.raw.set(key, message)  # type: ignore[arg-type]  # torch's stub says str; the store takes bytes
        self._accept_own(key, message)

    def _accept_own(self, key: str, message: bytes) -> None:
        self._latest[(key, self._writer)] = self._seq
        self._accepted[key] = (message, message.split(b".", 3)[3])

    def check(self, keys: Iterable[str]) -> bool:
        return all(self._current(k) is not None for k in keys)

    def read(self, key: str) -> bytes | None:
        """The authentic value under ``key`` now, or None (unset, deleted, or only forged values):
        never waits. What the agent reads with: a key another process deletes or withholds must
        not stop its detection loop (``get`` waits up to the store's timeout for it)."""
        return self._current(key)

    def get(self, key: str) -> bytes:
        """Like ``Store.get``: waits (up to the store's timeout) until ``key`` has an authentic value."""
        value = self._current(key)
        if value is None:
            self.wait([key])
            value = self._current(key)
        if value is None:  # wait() returned only once check() saw an authentic value
            raise InternalError(f"store key {key!r}: no authentic value right after waiting for one")
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Like ``Store.wait``, but a timeout raises ``LetoTimeoutError`` (other store errors,
        e.g. ``DistNetworkError`` when the host is gone, pass unchanged)."""
        limit = timeout if timeout is not None else self.timeout
        with store_timeouts(f"wait timeout: no value for {list(keys)} within {limit}"):
            self.raw.wait(list(keys), limit)
        deadline = time.monotonic() + limit.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise LetoTimeoutError(f"wait timeout: no authentic value for {list(keys)} within {limit}")
            time.sleep(POLL_S)

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes:
        """First writer wins (``expected=""`` only): the authentic value under ``key`` afterwards.
        A rejected value there counts as no value and is replaced."""
        if expected:
            raise ConfigurationError("SignedStore.compare_set supports expected='' (first writer wins) only")
        mine = self.sign(key, desired)
        current: bytes | str = ""
        while True:
            got = self.raw.compare_set(key, current, mine)  # type: ignore[arg-type]  # bytes, as above
            if got == mine:
                self._accept_own(key, mine)
                return self._accepted[key][1]
            value = self._verify(key, got)
            if value is not None:
                return value
            current = got  # not authentic: replace exactly that value

    def add(self, key: str, amount: int) -> int:
        """A signed counter (``amount`` 0 reads it)."""
        while True:
            raw = self.raw.get(key) if self.raw.check([key]) else b""
            value = self._verify(key, raw) if raw else b"0"
            if value is None:
                value = self._accepted.get(key, (b"", b"0"))[1]
            count = int(value)
            if amount == 0:
                return count
            mine = self.sign(key, str(count + amount))
            if self.raw.compare_set(key, raw, mine) == mine:  # type: ignore[arg-type]  # bytes, as above
                self._accept_own(key, mine)
                return count + amount
