"""The retained layout of the parameters a rank *owns* (ZeRO-1: ``ZeroRedundancyOptimizer``).

ZeRO-1 partitions the optimizer's parameters across ranks by whole parameters (greedily by
size, so the shares can be unequal); each rank steps only its own. A rank's store holds the
params it owns (fp32), their gradients and their optimizer state, one segment per param group.

Tier 2 stripes page ``p`` of every rank of a node, so every rank needs the same page map. Each
segment is therefore sized to the *largest* share any rank holds in that param group (rounded
up to whole chunks), and a rank with a smaller share leaves the rest as zero padding (zero
stays zero under SGD/Adam/AdamW). The param slots differ per rank; the regions do not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigurationError
from .layout import GRAD, PARAM, ParamSlot, Region, Segment, StoreLayout, dtype_name, state_kinds

# (name, shape) of one owned parameter; every parameter has the layout's one dtype
OwnedParam = tuple[str, tuple[int, ...]]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def owned_layout(owned: Sequence[Sequence[Sequence[OwnedParam]]], rank: int, *, dtype: torch.dtype, family: str,
                 group_options: Sequence[dict], page_bytes: int, chunk_pages: int = 1) -> StoreLayout:
    """The layout of ``rank``'s store: ``owned[r][g]`` lists what rank ``r`` owns in group ``g``
    (in the order of that rank's local optimizer). Every rank passes the same ``owned`` and gets
    the same regions; only the param slots are its own."""
    if not 0 <= rank < len(owned):
        raise ConfigurationError(f"rank {rank} is not one of the {len(owned)} ranks of the partition")
    n_groups = len(group_options)
    if any(len(groups) != n_groups for groups in owned):
        raise ConfigurationError(f"every rank's partition must have the optimizer's {n_groups} param groups")
    elem = torch.empty((), dtype=dtype).element_size()
    if page_bytes <= 0 or chunk_pages <= 0 or page_bytes % elem:
        raise ConfigurationError(f"page_bytes={page_bytes} must be a positive multiple of the {dtype_name(dtype)} "
                                 f"element size ({elem} B), and chunk_pages={chunk_pages} positive")
    chunk_elems = chunk_pages * page_bytes // elem
    segments: list[Segment] = []
    params: list[ParamSlot] = []
    regions: list[Region] = []
    next_page = next_chunk = 0
    for g in range(n_groups):
        widest = max(sum(_numel(shape) for _, shape in groups[g]) for groups in owned)
        n_chunks = max(1, -(-widest // chunk_elems))
        offset = 0
        for name, shape in owned[rank][g]:
            params.append(ParamSlot(len(params), name, tuple(shape), g, offset, _numel(shape)))
            offset += _numel(shape)
        kinds = (PARAM, GRAD) + state_kinds(family, group_options[g])
        n_pages = n_chunks * chunk_pages
        for kind in kinds:
            regions.append(Region(g, kind, next_page, n_pages))
            next_page += n_pages
        segments.append(Segment(g, g, dtype_name(dtype), elem, offset, n_chunks * chunk_elems, next_chunk, n_chunks,
                                kinds))
        next_chunk += n_chunks
    return StoreLayout(page_bytes, chunk_pages, family, tuple(segments), tuple(params), tuple(regions),
                       tuple(dict(o) for o in group_options))
