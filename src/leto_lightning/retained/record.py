"""The progress record: what a shadow needs to resume exactly, surviving a torn write.

Two slots (or two *pairs* of slots, ``copies=2``: each entry written twice, so one damaged slot
never loses the newest entry); each write goes to the slot (pair) *not* holding the newest valid
entry, so a write torn by a SIGKILL can only destroy the entry being written, never the last
good one. A slot is::

    magic u64 | seq u64 | length u64 | crc64 u64 | payload (pickle)

``seq`` grows by one per write; the reader takes the valid slot with the highest ``seq``. The
checksum covers seq, length and payload, so a partial write never validates.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigurationError

_MAGIC = 0x4C45544F52454344  # "LETORECD"
_HEADER = struct.Struct("<QQQQ")


class RecordTooLargeError(ConfigurationError):
    """A progress-record payload does not fit its slot (raise ``record_bytes``)."""


@dataclass
class RecordEntry:
    seq: int
    payload: Any


def _crc(seq: int, length: int, body: bytes) -> int:
    return zlib.crc32(body, zlib.crc32(struct.pack("<QQ", seq, length))) | (length << 32)


class ProgressRecord:
    """Double-buffered, checksummed, sequence-numbered record over a uint8 tensor.

    ``on_half_written`` lets fault-injection tests stop the writer in the middle of a slot.
    """

    def __init__(self, buffer: torch.Tensor, on_half_written: Callable[[], None] | None = None, copies: int = 1) -> None:
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

    def write(self, payload: Any) -> int:
        """Write ``payload`` as the next entry; returns its sequence number."""
        body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
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

    def _read_slot(self, slot: torch.Tensor) -> RecordEntry | None:
        header = bytes(slot[: _HEADER.size].numpy())
        magic, seq, length, crc = _HEADER.unpack(header)
        if magic != _MAGIC or length > self.capacity:
            return None
        body = bytes(slot[_HEADER.size : _HEADER.size + length].numpy())
        if _crc(seq, length, body) != crc:
            return None
        return RecordEntry(seq, pickle.loads(body))


def read_all(record: ProgressRecord) -> list[RecordEntry]:
    """Every intact entry, oldest first (at most two; an entry kept twice is listed once)."""
    entries = {e.seq: e for e in (record._read_slot(s) for s in record._slots) if e is not None}
    return [entries[seq] for seq in sorted(entries)]
