"""Which pages each parity page protects: tier-1 groups and tier-2 stripes.

Tier 1 (per device): the pages of every region are cut into groups of D consecutive pages;
each group has H1 parity pages. Groups never span two regions, so rewriting one kind of
buffer (e.g. re-encoding the gradients at prepare) never disturbs the parity of another.

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
        out: list[tuple[int, ...]] = []
        for r in self.layout.regions:
            if r.kind == GRAD and not self.include_grads:
                continue
            for start in range(r.first_page, r.first_page + r.n_pages, self.data_pages):
                out.append(tuple(range(start, min(start + self.data_pages, r.first_page + r.n_pages))))
        return tuple(out)

    @cached_property
    def page_group(self) -> np.ndarray:
        """Group of every page (-1: not protected by tier 1)."""
        out = np.full(self.layout.n_pages, -1, dtype=np.int64)
        for g, pages in enumerate(self.groups):
            out[list(pages)] = g
        return out

    def column(self, page: int) -> int:
        """Position of ``page`` inside its group: its column of the generator matrix."""
        return page - self.groups[int(self.page_group[page])][0]

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
