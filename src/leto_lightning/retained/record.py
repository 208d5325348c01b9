"""The progress record: what a shadow needs to resume exactly, surviving a torn write.

Two slots (or two *pairs* of slots, ``copies=2``: each entry written twice, so one damaged slot
never loses the newest entry); each write goes to the slot (pair) *not* holding the newest valid
entry, so a write torn by a SIGKILL can only destroy the entry being written, never the last
good one. A slot is::

    magic u64 | seq u64 | length u64 | crc64 u64 | payload (pickle)

``seq`` grows by one per write; the reader takes the valid slot with the highest ``seq``. The
checksum covers seq, length and payload, so a partial write never validates.

What an entry says is a ``ProgressEntry`` (the phase, ``RecordStatus``, of one iteration and
what resuming needs). This module alone turns it into bytes and back: on disk it is a plain
dict of builtins (and the integration's resume payload), so reading needs no class of this
package beyond what the payload itself names, and an entry that is not a valid progress entry
is reported, never taken for one.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..errors import CHECKPOINT_ADVICE, ConfigurationError, RecoveryError
from ..faults.points import point

__all__ = ["ProgressEntry", "ProgressRecord", "RecordEntry", "RecordStatus", "RecordTooLargeError", "read_all"]

_MAGIC = 0x4C45544F52454344  # "LETORECD"
_HEADER = struct.Struct("<QQQQ")


class RecordTooLargeError(ConfigurationError):
    """A progress-record payload does not fit its slot (raise ``record_bytes``)."""


class RecordStatus(str, Enum):
    """Phase of the iteration a progress entry describes.

    Transitions, all written by ``updater``: ``committed(t - 1) -> prepared(t)`` (the gradients
    of t are final and protected), ``prepared(t) -> committed(t)`` (every chunk of t updated; or
    recovery rolled t forward). Recovery may also write ``committed(t - 1)`` again after
    ``prepared(t)`` (t aborted: a peer never prepared it) or after an open ``t`` (rolled back).
    ``committed(t) -> committed(t)`` replaces the resume payload of the same iteration.
    """

    PREPARED = "prepared"
    COMMITTED = "committed"

    def __str__(self) -> str:  # "prepared", as the on-disk form and messages spell it
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class ProgressEntry:
    """What one progress-record entry says.

    ``payload``: the integration's resume payload (loop state, RNG, data position...).
    ``hparams`` / ``skip_params``: the update of a prepared iteration (what roll-forward redoes).
    ``open``: rollback window, the iteration is not sealed yet (recovery rolls it back).
    ``has_before`` / ``before``: rollback window, the sealed payload iteration ``iteration``
    started from (what a rollback of it resumes from); ``has_before`` tells a ``None`` payload
    from none kept.
    """

    status: RecordStatus
    iteration: int
    payload: Any = None
    hparams: tuple[dict[str, Any], ...] = ()
    skip_params: tuple[int, ...] = ()
    open: bool = False
    has_before: bool = False
    before: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, RecordStatus):
            raise ConfigurationError(f"ProgressEntry.status must be a RecordStatus, got {self.status!r}")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int):
            raise ConfigurationError(f"ProgressEntry.iteration must be an int, got {self.iteration!r}")

    @property
    def prepared(self) -> bool:
        return self.status is RecordStatus.PREPARED

    @property
    def committed(self) -> bool:
        return self.status is RecordStatus.COMMITTED


def _to_wire(entry: ProgressEntry) -> dict[str, Any]:
    """The on-disk form: a dict of builtins (the keys the record has always had)."""
    wire: dict[str, Any] = {"status": entry.status.value, "iteration": entry.iteration, "payload": entry.payload}
    if entry.prepared:
        wire["hparams"] = [dict(h) for h in entry.hparams]
        wire["skip_params"] = list(entry.skip_params)
    if entry.open:
        wire["open"] = True
    if entry.has_before:
        wire["before"] = entry.before
    return wire


def _from_wire(seq: int, wire: object) -> ProgressEntry:
    """Read back what ``_to_wire`` wrote; anything else is reported (a checksummed slot holding
    something that is not a progress entry: a bug or a foreign writer, never data to act on)."""

    def bad(why: str) -> RecoveryError:
        return RecoveryError(f"progress-record entry {seq} is not a progress entry ({why}). {CHECKPOINT_ADVICE}")

    if not isinstance(wire, Mapping):
        raise bad(f"a {type(wire).__name__}, not a dict")
    try:
        status = RecordStatus(wire.get("status"))
    except ValueError:
        raise bad(f"status {wire.get('status')!r}") from None
    iteration = wire.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int):
        raise bad(f"iteration {iteration!r}")
    hparams, skip = wire.get("hparams", ()), wire.get("skip_params", ())
    if status is RecordStatus.PREPARED and not (
        isinstance(hparams, Sequence) and all(isinstance(h, Mapping) for h in hparams)
        and isinstance(skip, Sequence) and all(isinstance(i, int) for i in skip)
    ):
        raise bad("a prepared entry without its hyper-parameters and skipped params")
    return ProgressEntry(status, iteration, wire.get("payload"), tuple(dict(h) for h in hparams), tuple(skip),
                         bool(wire.get("open", False)), "before" in wire, wire.get("before"))


@dataclass(frozen=True)
class RecordEntry:
    """An intact entry as read back: its sequence number and what it says."""

    seq: int
    progress: ProgressEntry


def _crc(seq: int, length: int, body: bytes) -> int:
    return zlib.crc32(body, zlib.crc32(struct.pack("<QQ", seq, length))) | (length << 32)


class ProgressRecord:
    """Double-buffered, checksummed, sequence-numbered record over a uint8 tensor.

    ``on_half_written`` lets fault-injection tests stop the writer in the middle of a slot.
    """

    def __init__(self, buffer: torch.Tensor, on_half_written: Callable[[], None] | None = None,
                 copies: int = 1) -> None:
        n = 2 * copies
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() % n:
            raise ConfigurationError(f"record buffer must be a 1-D uint8 tensor, a multiple of {n} bytes long")
        self._slot_bytes = buffer.numel() // n
        self._slots = tuple(buffer[i * self._slot_bytes : (i + 1) * self._slot_bytes] for i in range(n))
        self._pairs = (tuple(range(copies)), tuple(range(copies, n)))  # the slots one write fills
        self._on_half_written = on_half_written
        self._last: tuple[int, int] | None = None  # (pair, seq) of this process's last write

    @property
    def capacity(self) -> int:
        return self._slot_bytes - _HEADER.size

    def read(self) -> RecordEntry | None:
        """The newest intact entry, or None when nothing valid was ever written."""
        best: RecordEntry | None = None
        for slot in self._slots:
            entry = self._read_slot(slot)
            if entry is not None and (best is None or entry.seq > best.seq):
                best = entry
        return best

    def write(self, entry: ProgressEntry) -> int:
        """Write ``entry`` as the next entry; returns its sequence number."""
        if not isinstance(entry, ProgressEntry):
            raise ConfigurationError(f"the progress record holds ProgressEntry objects, got {type(entry).__name__}")
        body = pickle.dumps(_to_wire(entry), protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) > self.capacity:
            raise RecordTooLargeError(
                f"progress record of {len(body)} B exceeds the slot capacity {self.capacity} B; raise record_bytes"
            )
        pair, seq = self._next_pair()
        data = torch.frombuffer(bytearray(_HEADER.pack(_MAGIC, seq, len(body), _crc(seq, len(body), body)) + body),
                                dtype=torch.uint8)
        for i, slot in enumerate(self._pairs[pair]):
            target = self._slots[slot]
            # Invalidate the slot first: a crash from here on leaves it unreadable, never half-valid.
            target[:8].zero_()
            half = len(data) // 2
            target[8:half].copy_(data[8:half])
            if self._on_half_written is not None and i == 0:  # once per entry: kill points count entries
                self._on_half_written()
            target[half : len(data)].copy_(data[half:])
            target[:8].copy_(data[:8])  # the magic last: the slot becomes valid in one 8-byte store
        self._last = (pair, seq)
        return seq

    def _next_pair(self) -> tuple[int, int]:
        """(slots to overwrite, next seq): the pair not holding the newest valid entry."""
        if self._last is not None:  # only this process writes: no need to re-read the slots
            return 1 - self._last[0], self._last[1] + 1
        seqs = [max((e.seq for e in (self._read_slot(self._slots[i]) for i in pair) if e is not None), default=-1)
                for pair in self._pairs]
        newest = 0 if seqs[0] >= seqs[1] else 1
        return 1 - newest, max(seqs[newest], 0) + 1

    def repair_copies(self) -> list[int]:
        """Rewrite every slot that does not hold its pair's newest intact entry (damaged, or left
        behind by a write killed between the pair's two slots) from the slot that does; returns
        the slots rewritten. The source is never written, and the copy is made as ``write``
        makes one (magic last), so a kill here leaves at least what was intact before."""
        done = []
        for pair in self._pairs:
            found = {i: self._intact(self._slots[i]) for i in pair}
            newest = max((f for f in found.values() if f is not None), default=None)
            if newest is None:
                continue
            source = self._slots[next(i for i, f in found.items() if f == newest)]
            for i, f in found.items():
                if f != newest:
                    target, n = self._slots[i], _HEADER.size + newest[1]
                    target[:8].zero_()
                    target[8:n].copy_(source[8:n])
                    point("recovery.copy_rewrite", what="progress record", copy=i)
                    target[:8].copy_(source[:8])
                    done.append(i)
        return done

    def _intact(self, slot: torch.Tensor) -> tuple[int, int] | None:
        """(seq, length) of the entry in ``slot`` when its header and checksum are intact."""
        magic, seq, length, crc = _HEADER.unpack(bytes(slot[: _HEADER.size].numpy()))
        if magic != _MAGIC or length > self.capacity:
            return None
        if _crc(seq, length, bytes(slot[_HEADER.size : _HEADER.size + length].numpy())) != crc:
            return None
        return seq, length

    def _read_slot(self, slot: torch.Tensor) -> RecordEntry | None:
        intact = self._intact(slot)
        if intact is None:
            return None
        seq, length = intact
        body = bytes(slot[_HEADER.size : _HEADER.size + length].numpy())
        return RecordEntry(seq, _from_wire(seq, pickle.loads(body)))


def read_all(record: ProgressRecord) -> list[RecordEntry]:
    """Every intact entry, oldest first (at most two; an entry kept twice is listed once)."""
    entries = {e.seq: e for e in (record._read_slot(s) for s in record._slots) if e is not None}
    return [entries[seq] for seq in sorted(entries)]
