"""The progress record: what a shadow needs to resume exactly, surviving a torn write.

Two slots; each write goes to the slot *not* holding the newest valid entry, so a write torn
by a SIGKILL can only destroy the entry being written, never the last good one. A slot is::

    magic u64 | seq u64 | length u64 | crc64 u64 | payload (pickle)

``seq`` grows by one per write; the reader takes the valid slot with the highest ``seq``. The
checksum covers seq, length and payload, so a partial write never validates.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable

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

    def __init__(self, buffer: torch.Tensor, on_half_written: Callable[[], None] | None = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() % 2:
            raise ConfigurationError("record buffer must be a 1-D uint8 tensor of even length")
        self._slot_bytes = buffer.numel() // 2
        self._slots = (buffer[: self._slot_bytes], buffer[self._slot_bytes :])
        self._on_half_written = on_half_written
        self._last: tuple[int, int] | None = None  # (slot, seq) of this process's last write

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
        slot, seq = self._next_slot()
        target = self._slots[slot]
        data = torch.frombuffer(bytearray(_HEADER.pack(_MAGIC, seq, len(body), _crc(seq, len(body), body)) + body),
                                dtype=torch.uint8)
        # Invalidate the slot first: a crash from here on leaves it unreadable, never half-valid.
        target[:8].zero_()
        half = len(data) // 2
        target[8:half].copy_(data[8:half])
        if self._on_half_written is not None:
            self._on_half_written()
        target[half : len(data)].copy_(data[half:])
        target[:8].copy_(data[:8])  # the magic last: the slot becomes valid in one 8-byte store
        self._last = (slot, seq)
        return seq

    def _next_slot(self) -> tuple[int, int]:
        """(slot to overwrite, next seq): the slot not holding the newest valid entry."""
        if self._last is not None:  # only this process writes: no need to re-read both slots
            return 1 - self._last[0], self._last[1] + 1
        entries = [self._read_slot(s) for s in self._slots]
        seqs = [e.seq if e is not None else -1 for e in entries]
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
    """Every intact entry, oldest first (at most two)."""
    entries = [record._read_slot(s) for s in record._slots]
    return sorted((e for e in entries if e is not None), key=lambda e: e.seq)
