"""The retained layout of a rank's *local shards* (sharded training, e.g. FSDP2).

Under sharding a rank holds only its part of each parameter: rows ``[r * P, r * P + length)``
of dim 0, where ``P = ceil(dim0 / world)`` is the *padded* shard size every rank allocates
(the last ranks hold fewer real rows, or none). The retained slot of a sharded parameter is that
padded local shard, not the full parameter: params (the fp32 master copy), grads and optimizer
state of the shard live in the rank's store, and nothing is replicated across ranks. The
padding rows hold zeros and stay zero under SGD/Adam/AdamW (zero gradient, zero parameter).

Every rank's padded shards have the same shapes, so every rank of a node has the same layout
(tier 2 stripes pages across the node's ranks and needs that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigurationError
from .layout import StoreLayout, build_layout


@dataclass(frozen=True)
class LocalShard:
    """One parameter's local shard on this rank (sharded along dim 0)."""

    name: str
    global_shape: tuple[int, ...]  # the full parameter
    padded_shape: tuple[int, ...]  # what the rank allocates: dim 0 = ceil(global dim 0 / world)
    length: int  # real rows of dim 0 on this rank (0 <= length <= padded_shape[0])
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.padded_shape or tuple(self.padded_shape[1:]) != tuple(self.global_shape[1:]):
            raise ConfigurationError(f"shard {self.name}: padded shape {self.padded_shape} does not shard "
                                     f"{self.global_shape} along dim 0")
        if not 0 <= self.length <= self.padded_shape[0]:
            raise ConfigurationError(f"shard {self.name}: {self.length} real rows do not fit the padded shard "
                                     f"{self.padded_shape}")

    @property
    def padded_numel(self) -> int:
        n = 1
        for d in self.padded_shape:
            n *= d
        return n


def shard_layout(groups: Sequence[Sequence[LocalShard]], *, family: str, group_options: Sequence[dict],
                 page_bytes: int, chunk_pages: int = 1) -> StoreLayout:
    """The store layout of one rank's local shards, per param group (slots shaped like the
    padded shards)."""
    return build_layout([[(s.name, s.padded_shape, s.dtype) for s in members] for members in groups],
                        family=family, group_options=group_options, page_bytes=page_bytes,
                        chunk_pages=chunk_pages)
