"""Which pages each parity page protects: tier-1 groups and tier-2 stripes.

Tier 1 (per device): each group is D pages with H1 parity pages. The pages a chunk transaction
rewrites (a segment's params and optimizer state) are taken in the order the fused Adam update
walks them -- chunk 0's first param, ``exp_avg`` and ``exp_avg_sq`` pages, then its second
ones..., then chunk 1's -- and cut into groups of D in that order, so the pages updated
together mostly share their parity pages: the kernel folds the three deltas of a block into one
parity block while it is in cache, instead of three parity pages from three groups. The
gradients of a segment are grouped apart (D consecutive gradient pages), so re-encoding them at
prepare never disturbs the parity of the state.

Tier 2 (across the devices of a node): page ``p`` of every device forms stripe ``p`` -- all
ranks of a data-parallel job share the same layout -- with H2 parity pages. Only pages that
chunk transactions update (params and optimizer state) are striped; gradients are transient
(identical on every data-parallel rank after the all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .layout import GRAD, StoreLayout


@dataclass(frozen=True)
class Tier1Plan:
    """Tier-1 groups of one device's pages."""

    layout: StoreLayout
    data_pages: int
    parity_pages: int
    include_grads: bool

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        lay = self.layout
        out: list[tuple[int, ...]] = []
        for seg in lay.segments:
            kinds = lay.update_kinds(seg.index)
            updated = [lay.chunk_page_range(c, kind)[j] for c in range(seg.first_chunk, seg.first_chunk + seg.n_chunks)
                       for j in range(lay.chunk_pages) for kind in kinds]
            out += self._cut(updated)
            if self.include_grads and GRAD in seg.kinds:
                r = lay.region(seg.index, GRAD)
                out += self._cut(list(range(r.first_page, r.first_page + r.n_pages)))
        return tuple(out)

    def _cut(self, pages: list[int]) -> list[tuple[int, ...]]:
        return [tuple(pages[i : i + self.data_pages]) for i in range(0, len(pages), self.data_pages)]

    @cached_property
    def page_group(self) -> np.ndarray:
        """Group of every page (-1: not protected by tier 1)."""
        out = np.full(self.layout.n_pages, -1, dtype=np.int64)
        for g, pages in enumerate(self.groups):
            out[list(pages)] = g
        return out

    @cached_property
    def _columns(self) -> np.ndarray:
        out = np.full(self.layout.n_pages, -1, dtype=np.int64)
        for pages in self.groups:
            out[list(pages)] = np.arange(len(pages))
        return out

    def column(self, page: int) -> int:
        """Position of ``page`` inside its group: its column of the generator matrix."""
        return int(self._columns[page])

    @property
    def n_groups(self) -> int:
        return len(self.groups) if self.parity_pages else 0

    def groups_of(self, pages) -> list[int]:
        return sorted({int(self.page_group[p]) for p in pages if self.page_group[p] >= 0})

    def grad_groups(self) -> list[int]:
        kinds = self.layout.page_kind
        return [g for g, pages in enumerate(self.groups) if kinds[pages[0]] == GRAD]


@dataclass(frozen=True)
class Tier2Plan:
    """Tier-2 stripes: page ``p`` of each of ``n_devices`` devices, H2 parity pages each."""

    layout: StoreLayout
    n_devices: int
    parity_pages: int

    @property
    def enabled(self) -> bool:
        return self.n_devices >= 2 and self.parity_pages > 0

    @cached_property
    def page_stripe(self) -> np.ndarray:
        """Stripe of every page (-1: gradients, not striped)."""
        out = np.full(self.layout.n_pages, -1, dtype=np.int64)
        kinds = self.layout.page_kind
        stripe = 0
        for p in range(self.layout.n_pages):
            if kinds[p] != GRAD:
                out[p] = stripe
                stripe += 1
        return out

    @property
    def n_stripes(self) -> int:
        return int((self.page_stripe >= 0).sum()) if self.enabled else 0
