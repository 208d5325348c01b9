"""StoreSpec: what a process that knows only (job, rank) needs to rebuild a rank's views, and
how it is kept in the ``spec`` segment.

The spec is stored as plain JSON (never a pickle), twice, each copy behind a header with its
length and a CRC-64; a reader verifies both and takes the first that validates (recovery
rewrites a damaged copy, and a damaged mark, from the intact one). In front of each copy sits
one copy of the **completion mark**: "this store is completely initialised and
protected". It is written last, once every segment exists, the views are bound and all parity
(tier 2 included) is encoded, and it carries the CRC of the spec it belongs to. A store without
a valid mark was left half-initialised (its creator died during set-up) and recovery refuses it
(``IncompleteStoreError``).

Segment layout: two equal, page-aligned slots, so one overwritten page never hits both copies::

    slot 0: mark 0 (4 words) ... | magic, length, crc, json (at ``SLOT_JSON``) | slot 1: the same
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError, RetainedStateError
from ..faults.points import point
from ..protection.checksum import checksum
from .config import RetainedConfig
from .groups import Tier1Plan, Tier2Plan
from .layout import GenericState, ParamSlot, Region, Segment, StoreLayout
from .shm import segment_name

SLOT_JSON = 64  # offset of a slot's spec header: the mark sits before it
_SLOT_MAGIC = 0x4C45544F53504543  # "LETOSPEC"
_MARK_MAGIC = 0x4C45544F444F4E45  # "LETODONE"
_SLOT_HEAD = struct.Struct("<QQQ")  # magic, length, crc64 of the JSON
_MARK = struct.Struct("<QQQQ")  # magic, spec crc, mark index, crc32 of the three words before
PAGE = 4096  # meta areas are page-aligned: one overwritten page never destroys both copies of anything

# Undo header (int64 words of one copy): chunk, version, n_pages, n_pieces, then one crc per page,
# then the pieces' old step counters (float64 bits); ``seq`` and ``crc`` of the copy sit in the two
# words after the largest possible header (see ``StoreSpec.undo_header_words``).
UNDO_CHUNK, UNDO_VERSION, UNDO_NPAGES, UNDO_NPIECES, UNDO_CRCS = range(5)


@dataclass(frozen=True)
class StoreSpec:
    """Everything needed to (re)build a rank's views: plain values, no tensors."""

    job_id: str
    rank: int
    node: int
    local_rank: int
    n_local: int
    layout: StoreLayout
    config: RetainedConfig
    device_manager: str = ""  # backend="cuda": address of the state manager holding data and undo
    # Replicas (runtime/transfer.py rebuilds a lost rank's store from one): S > 0 means rank r holds
    # shard r % S of the state, as does every other rank with that shard -- DDP: 1 (every rank
    # holds everything), HSDP on an (R, S) mesh: S. 0: this rank's state exists nowhere else
    # (plain FSDP2, ZeRO-1).
    replica_shards: int = 0

    def __post_init__(self) -> None:
        if self.config.backend not in ("cpu", "cuda"):
            raise ConfigurationError(f"StoreSpec needs a resolved backend, got {self.config.backend!r}: "
                                     "RetainedConfig.for_device(<where the params are>) resolves 'auto'")

    def name(self, what: str) -> str:
        return segment_name(self.job_id, f"r{self.rank}", what)

    def node_name(self, what: str) -> str:
        return segment_name(self.job_id, f"node{self.node}", what)

    @cached_property
    def tier1(self) -> Tier1Plan:
        return Tier1Plan(self.layout, self.config.data_pages, self.config.tier1_parity, self.config.protect_grads)

    @cached_property
    def tier2(self) -> Tier2Plan:
        return Tier2Plan(self.layout, self.n_local, self.config.tier2_parity)

    @property
    def whole_state(self) -> bool:
        """Generic optimizers update everything in one transaction: the undo buffer holds it all."""
        return self.layout.family == "generic"

    @property
    def undo_header_words(self) -> int:
        """Words of one undo-header copy before its ``seq`` and ``crc`` words."""
        lay = self.layout
        return UNDO_CRCS + lay.max_chunk_update_pages + lay.max_chunk_pieces + 1  # +1: crc of a whole-state tail

    @property
    def meta_areas(self) -> dict[str, dict[str, int]]:
        """The meta segment: areas of int64 words, each area starting on its own page.

        ``primary``: the live chunk table ``[version, phase]``, step counters, page checksums,
        scalar state, flags and the checksum words (``sums``: one per chunk, then the gradients'
        and the scalar state's); ``mirror``: a second copy of everything but the phases;
        ``undo0``/``undo1``: two copies of the undo header; ``progress``: how many bytes per kind
        of the chunk in flight its undo copy holds (-1: all; the fused Adam kernel saves the copy
        block by block as it goes, see ``updater.fused_adam``).
        """
        lay = self.layout
        n_scalars = len(lay.params) * len(lay.scalar_kinds)
        copy = {"steps": lay.n_pieces, "crcs": lay.n_pages, "scalars": n_scalars, "flags": 8, "sums": lay.n_chunks + 2}
        head = {"words": self.undo_header_words + 2}
        return {"primary": {"chunks": 2 * lay.n_chunks, **copy}, "mirror": {"versions": lay.n_chunks, **copy},
                "undo0": head, "undo1": head, "progress": {"undo_bytes": 1}}

    def undo_bytes(self) -> int:
        lay = self.layout
        if not self.whole_state:
            return max(1, lay.max_chunk_update_pages) * lay.page_bytes
        # backups of crcs, steps, scalars and flags
        n_scalars = len(lay.params) * len(lay.scalar_kinds)
        backups = len(lay.update_pages) + lay.n_pieces + n_scalars + 8
        return len(lay.update_pages) * lay.page_bytes + 8 * backups

    def meta_area_bytes(self) -> int:
        """Bytes of the page-aligned word areas, before the four progress-record slots."""
        return sum(_page_round(8 * sum(area.values())) for area in self.meta_areas.values())

    def sizes(self) -> dict[str, int]:
        lay, cfg = self.layout, self.config
        sizes = {
            "data": lay.data_bytes,
            "undo": self.undo_bytes(),
            "parity1": max(1, self.tier1.n_groups * cfg.tier1_parity) * lay.page_bytes,
            "meta": self.meta_area_bytes() + 4 * cfg.record_bytes,  # the newest two records, twice each
        }
        if cfg.tier3_parity:  # the previous node's copy of its rank's data and meta, twice (updater/tier3.py)
            sizes["parity3"] = PAGE + 2 * _page_round(sizes["data"] + sizes["meta"])
        return sizes

    def parity2_bytes(self) -> int:
        return max(1, self.tier2.n_stripes * self.config.tier2_parity) * self.layout.page_bytes

    # -- encoding ------------------------------------------------------------------------------
    def to_json(self) -> bytes:
        return json.dumps(_plain(dataclasses.asdict(self)), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, blob: bytes) -> StoreSpec:
        d = _unplain(json.loads(blob.decode()))
        lay = d["layout"]
        layout = StoreLayout(
            lay["page_bytes"], lay["chunk_pages"], lay["family"],
            tuple(Segment(**{**s, "kinds": tuple(s["kinds"])}) for s in lay["segments"]),
            tuple(ParamSlot(**{**p, "shape": tuple(p["shape"])}) for p in lay["params"]),
            tuple(Region(**r) for r in lay["regions"]),
            tuple(dict(h) for h in lay["group_hparams"]), _generic_state(lay["generic"]))
        return cls(d["job_id"], d["rank"], d["node"], d["local_rank"], d["n_local"], layout,
                   RetainedConfig(**d["config"]), d.get("device_manager", ""), int(d.get("replica_shards", 0)))

    def spec_bytes(self) -> int:
        """Size of the spec segment: the marks' page and two slots holding the JSON."""
        slot = _page_round(SLOT_JSON + _SLOT_HEAD.size + len(self.to_json()) + 64)  # + 64: a longer manager address
        return 2 * slot


class SpecUnreadableError(RetainedStateError):
    """No copy of a store's spec is intact; the message lists what is wrong with each."""


def _generic_state(d: dict[str, Any] | None) -> GenericState | None:
    if d is None:
        return None
    return GenericState(tuple(d["elementwise"]), tuple(d["scalars"]), bool(d["has_step"]))


def _page_round(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


# JSON has no tuples: hyper-parameters such as ``betas`` keep their type through a tag. A value
# JSON cannot hold at all (an exotic param-group entry) is kept as its repr: the layout reads only
# the state kinds of SGD and Adam (momentum, amsgrad) from the hyper-parameters.
def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_plain(v) for v in value]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return {"__repr__": repr(value)}


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_unplain(v) for v in value["__tuple__"])
        if set(value) == {"__repr__"}:
            return value["__repr__"]
        return {k: _unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    return value


# -- the spec segment -------------------------------------------------------------------------
def _crc64(blob: bytes) -> int:
    return checksum(torch.frombuffer(bytearray(blob), dtype=torch.uint8)) if blob else 0


def _slots(buf: torch.Tensor, marks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The two slots' spec parts (``marks``: their mark parts)."""
    half = buf.numel() // 2
    if marks:
        return buf[:_MARK.size], buf[half : half + _MARK.size]
    return buf[SLOT_JSON:half], buf[half + SLOT_JSON : 2 * half]


def write_spec(buf: torch.Tensor, spec: StoreSpec) -> None:
    """Both copies of the spec (a new segment: the marks stay zero, i.e. "not complete")."""
    blob = spec.to_json()
    image = _SLOT_HEAD.pack(_SLOT_MAGIC, len(blob), _crc64(blob)) + blob
    for slot in _slots(buf):
        if len(image) > slot.numel():
            raise ConfigurationError(f"spec of {len(image)} B does not fit its {slot.numel()} B slot")
        slot[: len(image)].copy_(torch.frombuffer(bytearray(image), dtype=torch.uint8))


@dataclass(frozen=True)
class _SpecCopy:
    """One intact spec copy as found in its slot."""

    index: int
    spec: StoreSpec
    crc: int
    image_bytes: int  # header and JSON: what a copy to the other slot must take


def _read_copy(slot: torch.Tensor, index: int, name: str) -> _SpecCopy | str:
    """The copy in ``slot``, or what is wrong with it."""
    magic, length, crc = _SLOT_HEAD.unpack(bytes(slot[: _SLOT_HEAD.size].numpy()))
    if magic != _SLOT_MAGIC or length > slot.numel() - _SLOT_HEAD.size:
        return f"segment {name}: spec copy {index} has no valid header"
    blob = bytes(slot[_SLOT_HEAD.size : _SLOT_HEAD.size + length].numpy())
    if _crc64(blob) != crc:
        return f"segment {name}: spec copy {index} fails its checksum"
    try:
        return _SpecCopy(index, StoreSpec.from_json(blob), crc, _SLOT_HEAD.size + length)
    except (ValueError, KeyError, TypeError) as exc:  # a valid checksum over a spec of another version
        return f"segment {name}: spec copy {index} cannot be decoded ({type(exc).__name__}: {exc})"


def _intact_copies(buf: torch.Tensor, name: str) -> tuple[list[_SpecCopy], list[str]]:
    found = [_read_copy(slot, i, name) for i, slot in enumerate(_slots(buf))]
    return [c for c in found if isinstance(c, _SpecCopy)], [f for f in found if isinstance(f, str)]


def _chosen(buf: torch.Tensor, copies: list[_SpecCopy]) -> _SpecCopy:
    """The copy to trust: the first, unless only the other one has a completion mark of its own
    (two intact copies that differ: one was written for another spec)."""
    marked = [c for c in copies if valid_marks(buf, c.crc)]
    return (marked or copies)[0]


def read_spec(buf: torch.Tensor, name: str) -> tuple[StoreSpec, int, list[str]]:
    """The spec from an intact copy; its crc; and what is wrong with the other copy.

    Both copies are verified: a damaged copy never read would go unnoticed (and unrepaired) until
    the other one is hit too. Raises ``SpecUnreadableError`` (caught by the store, which knows
    what to call it) when no copy is intact.
    """
    copies, findings = _intact_copies(buf, name)
    if not copies:
        raise SpecUnreadableError(" ".join(findings))
    chosen = _chosen(buf, copies)
    findings += [f"segment {name}: spec copy {c.index} differs from copy {chosen.index}"
                 for c in copies if c.crc != chosen.crc]
    return chosen.spec, chosen.crc, findings


def repair_spec_segment(buf: torch.Tensor, name: str, spec_crc: int) -> list[str]:
    """Verify both spec copies and both completion marks of a *complete* store (the caller checked
    that one mark is valid) and rewrite each damaged one from an intact one; returns what was
    rewritten. Only damaged copies are written (the intact one is the source and is never
    touched), so a kill during the repair leaves at least what was there before."""
    copies, _ = _intact_copies(buf, name)
    good = next((c for c in copies if c.crc == spec_crc), None)
    if good is None:  # pragma: no cover - the store's spec was read from an intact copy
        raise SpecUnreadableError(f"segment {name}: no spec copy with crc {spec_crc:#x} is left")
    slots, done = _slots(buf), []
    for i, slot in enumerate(slots):
        if not any(c.index == i and c.crc == spec_crc for c in copies):
            source = slots[good.index][: good.image_bytes]
            slot[:8].zero_()  # no magic (invalid) while it is rewritten; the magic goes last
            slot[8 : good.image_bytes].copy_(source[8:])
            point("recovery.copy_rewrite", what="spec", copy=i)
            slot[:8].copy_(source[:8])
            done.append(f"segment {name}: spec copy {i} (rewritten)")
    for i, view in enumerate(_slots(buf, marks=True)):
        words = _mark_words(spec_crc, i)
        if bytes(view.numpy()) != words:
            point("recovery.copy_rewrite", what="completion mark", copy=i)
            view.copy_(torch.frombuffer(bytearray(words), dtype=torch.uint8))
            done.append(f"segment {name}: completion mark copy {i} (rewritten)")
    return done


def _mark_words(spec_crc: int, index: int) -> bytes:
    body = struct.pack("<QQQ", _MARK_MAGIC, spec_crc, index)
    return body + struct.pack("<Q", zlib.crc32(body))


def write_marks(buf: torch.Tensor, spec_crc: int | None) -> None:
    """Set (``spec_crc``) or clear (None) both copies of the completion mark."""
    for index, view in enumerate(_slots(buf, marks=True)):
        if spec_crc is None:
            view.zero_()
        else:
            view.copy_(torch.frombuffer(bytearray(_mark_words(spec_crc, index)), dtype=torch.uint8))


def valid_marks(buf: torch.Tensor, spec_crc: int) -> list[int]:
    """Indices of the mark copies that are intact and belong to the spec with ``spec_crc``."""
    return [i for i, view in enumerate(_slots(buf, marks=True)) if bytes(view.numpy()) == _mark_words(spec_crc, i)]


def any_mark(buf: torch.Tensor) -> bool:
    """Whether anything was ever written where the marks go (tells "never completed" from damage)."""
    return any(bool(view.any()) for view in _slots(buf, marks=True))


def words_crc(seed: int, *arrays: np.ndarray) -> int:
    """CRC-32 of small metadata arrays, seeded with what they describe (e.g. a chunk index) so a
    copy moved to another place never validates there. Returned as a non-negative int64."""
    crc = zlib.crc32(seed.to_bytes(8, "little", signed=True))
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a), crc)  # type: ignore[arg-type]  # a buffer; numpy's stubs lack it
    return crc | (1 << 32)  # bit 32 set: a zeroed word is never a valid checksum
