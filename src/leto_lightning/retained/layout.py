"""Where every retained byte lives: flat per-dtype buffers cut into fixed-size pages.

The layout is pure metadata (picklable, no tensors), so a shadow trainer or a recovery
process can rebuild the exact same views over memory it did not allocate.

Shape of the data area of one rank::

    segment 0 (param group 0, float32):  | param | grad | exp_avg | exp_avg_sq |
    segment 1 (param group 0, bfloat16):  | param | grad | ... |
    ...

Each box is a *region*: ``padded_numel`` elements of one *kind* (params, grads, or one
optimizer-state buffer), a whole number of pages. Element ``i`` of a segment sits at the same
offset in every region of that segment, so a *chunk* -- elements ``[l*E, (l+1)*E)`` of a
segment -- is the same page range in each region: the unit of a chunk transaction (docs/design.md
section 2.3). Segments never mix dtypes or param groups, so one chunk has one set of
hyper-parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ..errors import ConfigurationError

PARAM = "param"
GRAD = "grad"


@dataclass(frozen=True)
class GenericState:
    """What a generic optimizer (one without a chunk-wise update) keeps per parameter, found by
    running its class once (``updater.whole_state.probe_state``). Part of the layout, not of
    the param groups' hyper-parameters: the user's settings stay the user's."""

    elementwise: tuple[str, ...] = ()  # state tensors shaped like the param: regions of its segment
    scalars: tuple[str, ...] = ()  # 0-dim float32 state besides "step": the scalar area
    has_step: bool = False  # a "step" counter, kept in the step counters


# Optimizer-state buffers per supported optimizer family, shaped like the parameter.
_STATE_KINDS = {
    "sgd": lambda g, _: ("momentum_buffer",) if g.get("momentum", 0) != 0 else (),
    "adam": lambda g, _: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g.get("amsgrad") else ()),
    # any other optimizer: the per-element state keys found by probing it (updater.whole_state)
    "generic": lambda _, generic: generic.elementwise if generic is not None else (),
}


def state_kinds(family: str, group: dict, generic: GenericState | None = None) -> tuple[str, ...]:
    """The per-element optimizer-state buffers a param group of ``family`` needs."""
    if family not in _STATE_KINDS:
        raise ConfigurationError(f"unknown optimizer family {family!r}; known: {sorted(_STATE_KINDS)}")
    return _STATE_KINDS[family](group, generic)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter: which segment holds it and at which element offset."""

    index: int  # position in the flat list of all params (param-group order)
    name: str
    shape: tuple[int, ...]
    segment: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Region:
    """One kind of buffer (params, grads, ``exp_avg``...) of one segment."""

    segment: int
    kind: str
    first_page: int
    n_pages: int


@dataclass(frozen=True)
class Segment:
    index: int
    group: int
    dtype: str
    elem_size: int
    numel: int
    padded_numel: int
    first_chunk: int
    n_chunks: int
    kinds: tuple[str, ...]  # PARAM, GRAD, then the optimizer-state kinds


@dataclass(frozen=True)
class StoreLayout:
    """The complete map of one rank's retained memory.

    ``chunk_pages`` pages of every region make one chunk; ``page_bytes`` must be a multiple
    of every element size (checked on construction).
    """

    page_bytes: int
    chunk_pages: int
    family: str
    segments: tuple[Segment, ...]
    params: tuple[ParamSlot, ...]
    regions: tuple[Region, ...]
    group_hparams: tuple[dict, ...] = field(default=(), compare=False)
    generic: GenericState | None = None  # family "generic": what the optimizer keeps per parameter

    @property
    def scalar_kinds(self) -> tuple[str, ...]:
        """Per-param 0-dim state besides "step" (generic family)."""
        return self.generic.scalars if self.generic is not None else ()

    @cached_property
    def update_pages(self) -> tuple[int, ...]:
        """Every page a whole-state transaction rewrites (all but the gradients), in order."""
        return tuple(p for p in range(self.n_pages) if self.page_kind[p] != GRAD)

    @property
    def n_pages(self) -> int:
        return sum(r.n_pages for r in self.regions)

    @property
    def n_chunks(self) -> int:
        return sum(s.n_chunks for s in self.segments)

    @property
    def data_bytes(self) -> int:
        return self.n_pages * self.page_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_pages * self.page_bytes

    def region(self, segment: int, kind: str) -> Region:
        return self._region_index[(segment, kind)]

    @cached_property
    def _region_index(self) -> dict[tuple[int, str], Region]:
        return {(r.segment, r.kind): r for r in self.regions}

    @cached_property
    def chunk_segment(self) -> np.ndarray:
        """Segment index of every chunk."""
        out = np.empty(self.n_chunks, dtype=np.int64)
        for s in self.segments:
            out[s.first_chunk : s.first_chunk + s.n_chunks] = s.index
        return out

    def chunk_page_range(self, chunk: int, kind: str) -> range:
        """Pages of ``kind`` that chunk ``chunk`` covers."""
        seg = self.segments[int(self.chunk_segment[chunk])]
        local = chunk - seg.first_chunk
        first = self.region(seg.index, kind).first_page + local * self.chunk_pages
        return range(first, first + self.chunk_pages)

    def update_kinds(self, segment: int) -> tuple[str, ...]:
        """Kinds a chunk transaction rewrites: the params and their optimizer state."""
        return tuple(k for k in self.segments[segment].kinds if k != GRAD)

    def chunk_pages_updated(self, chunk: int) -> list[int]:
        seg = int(self.chunk_segment[chunk])
        return [p for k in self.update_kinds(seg) for p in self.chunk_page_range(chunk, k)]

    @cached_property
    def chunk_pieces(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per chunk, its *pieces*: ``(param_index, start, stop)`` element ranges relative to
        the chunk, one per parameter the chunk overlaps (padding excluded).

        Pieces carry their own optimizer step counter: a parameter spanning three chunks
        steps once per iteration, and a parameter without a gradient is skipped, exactly as
        ``torch.optim`` does per parameter.
        """
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n_chunks)]
        for slot in self.params:
            seg = self.segments[slot.segment]
            elems = self.chunk_bytes // seg.elem_size
            pos, end = slot.offset, slot.offset + slot.numel
            while pos < end:
                local = pos // elems
                stop = min(end, (local + 1) * elems)
                out[seg.first_chunk + local].append((slot.index, pos - local * elems, stop - local * elems))
                pos = stop
        for pieces in out:
            pieces.sort(key=lambda piece: piece[1])
        return tuple(tuple(p) for p in out)

    @cached_property
    def chunk_first_piece(self) -> tuple[int, ...]:
        """Global index of each chunk's first piece (pieces are numbered chunk by chunk)."""
        firsts, n = [], 0
        for pieces in self.chunk_pieces:
            firsts.append(n)
            n += len(pieces)
        return tuple(firsts)

    @property
    def n_pieces(self) -> int:
        return sum(len(p) for p in self.chunk_pieces)

    @cached_property
    def max_chunk_pieces(self) -> int:
        return max((len(p) for p in self.chunk_pieces), default=0)

    @cached_property
    def param_first_piece(self) -> tuple[int, ...]:
        """The piece holding each parameter's first element: its visible step counter."""
        first = [-1] * len(self.params)
        for c, pieces in enumerate(self.chunk_pieces):
            for i, (param, _, _) in enumerate(pieces):
                if first[param] < 0:
                    first[param] = self.chunk_first_piece[c] + i
        return tuple(first)

    @cached_property
    def page_kind(self) -> tuple[str, ...]:
        kinds: list[str] = [""] * self.n_pages
        for r in self.regions:
            kinds[r.first_page : r.first_page + r.n_pages] = [r.kind] * r.n_pages
        return tuple(kinds)

    @cached_property
    def max_chunk_update_pages(self) -> int:
        """Pages in the largest chunk transaction: the size of the undo buffer."""
        return max((len(self.update_kinds(s.index)) * self.chunk_pages for s in self.segments), default=0)

    def describe(self) -> str:
        kinds = sorted({r.kind for r in self.regions})
        return (
            f"{len(self.params)} params in {len(self.segments)} segments, {self.n_pages} pages of "
            f"{self.page_bytes} B ({self.data_bytes / 2**20:.1f} MiB), {self.n_chunks} chunks, kinds {kinds}"
        )


def build_layout(
    groups: Sequence[Sequence[tuple[str, Sequence[int], torch.dtype]]],
    *,
    family: str,
    group_options: Sequence[dict] | None = None,
    page_bytes: int,
    chunk_pages: int = 1,
    generic: GenericState | None = None,
) -> StoreLayout:
    """Lay out the params of each param group (``(name, shape, dtype)`` triples).

    Params of one group and dtype are packed back to back into one segment (no per-param
    alignment: the optimizer math is element-wise, so chunks may cut across params).
    """
    group_options = list(group_options or [{} for _ in groups])
    if len(group_options) != len(groups):
        raise ConfigurationError("group_options must have one entry per param group")
    if generic is not None and family != "generic":
        raise ConfigurationError(f"family {family!r} keeps no probed state: GenericState is for family 'generic'")
    if page_bytes <= 0 or chunk_pages <= 0:
        raise ConfigurationError(f"page_bytes ({page_bytes}) and chunk_pages ({chunk_pages}) must be positive")
    segments: list[Segment] = []
    params: list[ParamSlot] = []
    regions: list[Region] = []
    next_page = next_chunk = param_index = 0  # param_index: first flat index of the group
    for g, members in enumerate(groups):
        kinds = (PARAM, GRAD) + state_kinds(family, group_options[g], generic)
        for dtype, items in _by_dtype(members):
            elem = torch.empty((), dtype=dtype).element_size()
            if page_bytes % elem:
                raise ConfigurationError(
                    f"page_bytes={page_bytes} is not a multiple of the {dtype_name(dtype)} element size ({elem} B)"
                )
            seg_index = len(segments)
            offset = 0
            for index, name, shape in items:
                numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
                params.append(ParamSlot(param_index + index, name, tuple(shape), seg_index, offset, numel))
                offset += numel
            chunk_elems = chunk_pages * page_bytes // elem
            n_chunks = max(1, -(-offset // chunk_elems))
            padded = n_chunks * chunk_elems
            for kind in kinds:
                n = padded * elem // page_bytes
                regions.append(Region(seg_index, kind, next_page, n))
                next_page += n
            segments.append(Segment(seg_index, g, dtype_name(dtype), elem, offset, padded, next_chunk, n_chunks, kinds))
            next_chunk += n_chunks
        param_index += len(members)
    params.sort(key=lambda p: p.index)
    return StoreLayout(page_bytes, chunk_pages, family, tuple(segments), tuple(params), tuple(regions),
                       tuple(dict(o) for o in group_options), generic)


def _by_dtype(members: Iterable[tuple[str, Sequence[int], torch.dtype]]):
    """Group a param group's members by dtype, keeping first-seen order (deterministic).

    Yields ``(dtype, [(index_in_group, name, shape), ...])``.
    """
    order: dict[torch.dtype, list[tuple[int, str, Sequence[int]]]] = {}
    for i, (name, shape, dtype) in enumerate(members):
        order.setdefault(dtype, []).append((i, name, shape))
    return order.items()
