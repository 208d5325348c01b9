"""Find damaged pages and rebuild them from parity, tier 1 first, then tier 2; verify parity.

Every data page has a checksum recorded when it was last written; a mismatch is an erasure
at a known position. Rebuilding alternates between the tiers until nothing more can be
done: a tier-2 rebuild can bring a tier-1 group back within reach and vice versa. Every
rebuilt page is checked against its recorded checksum before it counts as repaired -- a
wrong parity page can never slip a wrong page through: a rebuild that fails its checksums is
tried again with another choice of parity pages, so any intact ones are used. What is left
raises ``UnrecoverableDamageError`` naming the pages and groups: nothing is silently wrong.

Parity itself carries no checksum: once every data page of a group is verified, the group's
parity is a function of them. ``verify_parity`` re-encodes each group and rewrites the parity
pages that differ (damaged, or left stale by an update or a recovery that was killed).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import UnrecoverableDamageError
from ..faults.points import point
from ..protection.codec import ReedSolomonCode
from ..retained.layout import GRAD
from ..retained.store import RetainedStore
from .device_pages import DevicePages

__all__ = ["RepairReport", "UnrecoverableDamageError", "find_damage", "page_ok", "repair", "verify_parity"]


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
    return store.page_checksums([page])[0] == int(store.crcs[page])


def find_damage(store: RetainedStore, include_grads: bool) -> list[int]:
    """Pages whose contents no longer match their recorded checksum (on a device, hashed there in
    batches)."""
    kinds = store.layout.page_kind
    pages = [p for p in range(store.layout.n_pages) if include_grads or kinds[p] != GRAD]
    recorded = store.crcs.numpy()
    return [p for p, crc in zip(pages, store.page_checksums(pages)) if crc != int(recorded[p])]


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


def rebuild(code: ReedSolomonCode, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor],
            missing: list[int], check) -> bool:
    """Rebuild ``data[i] for i in missing`` in place; ``check(i)`` verifies a rebuilt page.

    Tries the parity pages in every combination of ``len(missing)`` of them until all rebuilt
    pages pass ``check``: a damaged parity page is then simply left out. Works on copies of the
    parity (``reconstruct`` also rewrites the parity rows it did not use). False: no choice works.
    """
    for rows in itertools.combinations(range(code.m), len(missing)):
        unused = [j for j in range(code.m) if j not in rows]
        code.reconstruct(data, [p.clone() for p in parity], missing, unused)
        if all(check(i) for i in missing):
            return True
    return False


def _tier1_pass(store: RetainedStore, code, lost: set[int], done: list[int], details: list[str]) -> bool:
    if code is None or not lost:
        return False
    plan = store.spec.tier1
    progress = False
    for g in plan.groups_of(sorted(lost)):
        pages = plan.groups[g]
        missing = [i for i, p in enumerate(pages) if p in lost]
        if len(missing) > code.m:
            details.append(f"Tier-1 group {g} (pages {pages[0]}..{pages[-1]}) lost {len(missing)} pages, "
                           f"has {code.m} parity.")
            continue
        if rebuild(code, [store.pages[p] for p in pages], list(store.parity1[g]), missing,
                   lambda i, pages=pages: page_ok(store, pages[i])):
            lost.difference_update(pages[i] for i in missing)
            done.extend(pages[i] for i in missing)
            progress = True
        else:
            details.append(f"Tier-1 rebuild of pages {[pages[i] for i in missing]} (group {g}) failed their checksums "
                           f"with every choice of {len(missing)} of its {code.m} parity pages (parity damaged too?).")
    return progress


def _tier2_pass(stores: Mapping[int, RetainedStore], code, lost: dict[int, set[int]], done: dict,
                details: list[str]) -> bool:
    if code is None or len(stores) < 2:
        return False
    any_store = next(iter(stores.values()))
    plan = any_store.spec.tier2
    if len(stores) != plan.n_devices:
        details.append(f"Tier 2 needs all {plan.n_devices} devices' stores, got {len(stores)}.")
        return False
    progress = False
    ranks = sorted(stores)
    for page in sorted(set().union(*lost.values())):
        stripe = int(plan.page_stripe[page])
        if stripe < 0:
            continue
        missing = [r for r in ranks if page in lost[r]]
        if len(missing) > code.m:
            details.append(f"Tier-2 stripe {stripe} lost page {page} on {len(missing)} devices, has {code.m} parity.")
            continue
        if rebuild(code, [stores[r].pages[page] for r in ranks], any_store.tier2_parity(stripe),
                   [ranks.index(r) for r in missing], lambda i, page=page: page_ok(stores[ranks[i]], page)):
            for r in missing:
                lost[r].discard(page)
                done.setdefault(r, []).append(page)
            progress = True
        else:
            details.append(f"Tier-2 rebuild of page {page} on devices {missing} (stripe {stripe}) "
                           "failed its checksums.")
    return progress


def verify_parity(stores: Mapping[int, RetainedStore], tier1: ReedSolomonCode | None, tier2: ReedSolomonCode | None,
                  include_grads: Collection[int] | bool) -> tuple[dict[int, list[int]], list[int]]:
    """Re-encode every group (and, with all the node's stores, every tier-2 stripe) whose parity
    differs from its verified data pages; returns ``({local rank: groups}, stripes)`` rewritten.

    Gradient groups count only for the ranks in ``include_grads`` (elsewhere the gradients are
    transient and the next prepare re-encodes their parity).
    """
    groups: dict[int, list[int]] = {}
    for r, store in stores.items():
        if tier1 is None:
            break
        grads = include_grads is True or (include_grads is not False and r in include_grads)
        kinds, plan = store.layout.page_kind, store.spec.tier1
        checked = [g for g, pages in enumerate(plan.groups) if grads or kinds[pages[0]] != GRAD]
        device = DevicePages(store, tier1, pin_parity=False) if store.hashes_on_device else None
        if device is not None and device.xor:  # XOR parity: recomputed on the device, compared on the host
            for g in device.stale_groups(checked):
                device.refresh(plan.groups[g])
                groups.setdefault(r, []).append(g)
                point("recovery.parity_partial", group=g)
            continue
        for g in checked:
            data, parity = [store.pages[p] for p in plan.groups[g]], list(store.parity1[g])
            if tier1.verify(data, parity):
                tier1.encode(data, parity)
                groups.setdefault(r, []).append(g)
                point("recovery.parity_partial", group=g)
    stripes: list[int] = []
    first = next(iter(stores.values()))
    if tier2 is not None and first.spec.tier2.enabled and len(stores) == first.spec.tier2.n_devices:
        ranks = sorted(stores)
        for page, stripe in enumerate(first.spec.tier2.page_stripe):
            if stripe < 0:
                continue
            data, parity = [stores[r].pages[page] for r in ranks], first.tier2_parity(int(stripe))
            if tier2.verify(data, parity):
                tier2.encode(data, parity)
                stripes.append(int(stripe))
    return groups, stripes


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
