"""Find damaged pages and rebuild them from parity, tier 1 first, then tier 2.

Every data page has a checksum recorded when it was last written; a mismatch is an erasure
at a known position. Rebuilding alternates between the tiers until nothing more can be
done: a tier-2 rebuild can bring a tier-1 group back within reach and vice versa. Every
rebuilt page is checked against its recorded checksum before it counts as repaired -- a
wrong parity page can never slip a wrong page through. What is left raises
``UnrecoverableDamageError`` naming the pages and groups: nothing is silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

from ..retained.layout import GRAD
from ..retained.store import RetainedStore
from .checksum import checksum
from .codec import ReedSolomonCode
from .errors import UnrecoverableDamageError

__all__ = ["RepairReport", "UnrecoverableDamageError", "find_damage", "page_ok", "repair"]


@dataclass
class RepairReport:
    damaged: dict[int, list[int]] = field(default_factory=dict)  # rank -> pages found bad
    tier1: dict[int, list[int]] = field(default_factory=dict)  # rank -> pages rebuilt by tier 1
    tier2: dict[int, list[int]] = field(default_factory=dict)
    peer_copy: dict[int, list[int]] = field(default_factory=dict)  # gradient pages copied from a peer

    @property
    def repaired(self) -> int:
        return sum(len(v) for d in (self.tier1, self.tier2, self.peer_copy) for v in d.values())


def page_ok(store: RetainedStore, page: int) -> bool:
    crc = checksum(store.pages[page])
    return (crc - (1 << 64) if crc >= (1 << 63) else crc) == int(store.crcs[page])


def find_damage(store: RetainedStore, include_grads: bool) -> list[int]:
    """Pages whose contents no longer match their recorded checksum."""
    kinds = store.layout.page_kind
    return [p for p in range(store.layout.n_pages) if (include_grads or kinds[p] != GRAD) and not page_ok(store, p)]


def repair(
    stores: Mapping[int, RetainedStore],
    tier1: ReedSolomonCode | None,
    tier2: ReedSolomonCode | None,
    include_grads: Collection[int] | bool,
) -> RepairReport:
    """Verify every page of the node's ranks (keyed by local rank) and rebuild the damaged.

    ``include_grads``: the local ranks whose gradients must be intact (those that will roll
    forward with them); ``True`` means all.
    """
    report = RepairReport()
    lost: dict[int, set[int]] = {}
    for r, store in stores.items():
        bad = find_damage(store, include_grads is True or (include_grads is not False and r in include_grads))
        lost[r] = set(bad)
        if bad:
            report.damaged[r] = bad
    details: list[str] = []
    progress = True
    while progress and any(lost.values()):
        progress = False
        for r, store in stores.items():
            progress |= _tier1_pass(store, tier1, lost[r], report.tier1.setdefault(r, []), details)
        progress |= _tier2_pass(stores, tier2, lost, report.tier2, details)
        progress |= _peer_grad_pass(stores, lost, report.peer_copy)
    if any(lost.values()):
        raise UnrecoverableDamageError({r: sorted(p) for r, p in lost.items()}, details)
    return report


def _tier1_pass(store: RetainedStore, code, lost: set[int], done: list[int], details: list[str]) -> bool:
    if code is None or not lost:
        return False
    plan = store.spec.tier1
    progress = False
    for g in plan.groups_of(sorted(lost)):
        pages = plan.groups[g]
        missing = [i for i, p in enumerate(pages) if p in lost]
        if len(missing) > code.m:
            details.append(f"Tier-1 group {g} (pages {pages[0]}..{pages[-1]}) lost {len(missing)} pages, has {code.m} parity.")
            continue
        code.reconstruct([store.pages[p] for p in pages], list(store.parity1[g]), missing)
        for i in missing:
            if page_ok(store, pages[i]):
                lost.discard(pages[i])
                done.append(pages[i])
                progress = True
            else:
                details.append(f"Tier-1 rebuild of page {pages[i]} failed its checksum (parity of group {g} damaged?).")
    return progress


def _tier2_pass(stores: Mapping[int, RetainedStore], code, lost: dict[int, set[int]], done: dict, details: list[str]) -> bool:
    if code is None or len(stores) < 2:
        return False
    any_store = next(iter(stores.values()))
    plan = any_store.spec.tier2
    if len(stores) != plan.n_devices:
        details.append(f"Tier 2 needs all {plan.n_devices} devices' stores, got {len(stores)}.")
        return False
    progress = False
    for page in sorted(set().union(*lost.values())):
        stripe = int(plan.page_stripe[page])
        if stripe < 0:
            continue
        missing = [r for r in sorted(stores) if page in lost[r]]
        if len(missing) > code.m:
            details.append(f"Tier-2 stripe {stripe} lost page {page} on {len(missing)} devices, has {code.m} parity.")
            continue
        ranks = sorted(stores)
        code.reconstruct([stores[r].pages[page] for r in ranks], list(any_store.parity2[stripe]), [ranks.index(r) for r in missing])
        for r in missing:
            if page_ok(stores[r], page):
                lost[r].discard(page)
                done.setdefault(r, []).append(page)
                progress = True
            else:
                details.append(f"Tier-2 rebuild of page {page} on device {r} failed its checksum.")
    return progress


def _peer_grad_pass(stores: Mapping[int, RetainedStore], lost: dict[int, set[int]], done: dict) -> bool:
    """Data-parallel ranks hold identical reduced gradients: copy a lost gradient page from a
    peer whose page matches the lost page's recorded checksum (so it is provably the same)."""
    progress = False
    for r, pages in lost.items():
        kinds = stores[r].layout.page_kind
        for page in sorted(p for p in pages if kinds[p] == GRAD):
            for q, peer in stores.items():
                if q != r and page not in lost[q] and int(peer.crcs[page]) == int(stores[r].crcs[page]):
                    stores[r].pages[page].copy_(peer.pages[page])
                    if page_ok(stores[r], page):
                        pages.discard(page)
                        done.setdefault(r, []).append(page)
                        progress = True
                        break
    return progress
