"""The parity and checksums of pages in device memory (the CUDA backend), computed on the device.

A chunk transaction on host pages folds each page's change into its parity and checksums it on
the host (``transaction.py``, the fused Adam kernel). On device pages that would move every
rewritten page -- and, as ``old ^ new`` deltas, twice -- over PCIe. Here the device does the
reading and only results cross (docs/cuda-backend.md, "The update path on the device"):

* tier-1 parity with H1 = 1 (the XOR of each group's pages): each group a chunk touched is
  **re-encoded** on the device from its D current pages (``protection.device.xor_groups``, all the
  chunk's groups in a few batched kernels) and its one parity page is copied into host parity --
  one page per group crosses, not D, and the host does no arithmetic. Re-encoding instead of
  folding ``new ^ old`` reads the group once and writes the parity page whole; it is exact
  whatever the other pages of a group straddling two chunks hold (parity is a function of the
  pages as they are). A crash between the copy and the commit mark leaves parity that matches
  the new pages; recovery restores the chunk from the undo buffer and re-encodes every group
  whose parity differs from its verified data (``repair.verify_parity``).
* H1 > 1 (a Reed-Solomon row that is not all ones): the same groups re-encoded through the codec
  (``protection.staging.encode``: the torch engine on the device, the H1 pages cross).
* checksums: ``protection.device.page_hashes`` over the pages, on the device; the int64 results
  come back with the parity, in one wait for the device per chunk.

The host parity segment is registered with CUDA (``cudaHostRegister``) where possible, so those
copies run at DMA speed instead of through a pageable bounce buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..protection.codec import ReedSolomonCode
from ..protection.device import page_hashes, xor_groups, xor_pages
from ..retained.store import RetainedStore

log = logging.getLogger(__name__)


@dataclass
class GroupRefresh:
    """The tier-1 groups a set of pages belongs to, resolved once for the device."""

    groups: list[int]
    full: list[int]  # groups of exactly D pages: one batched XOR
    full_index: torch.Tensor | None  # (len(full), D) page numbers, on the device
    short: list[tuple[int, tuple[int, ...]]]  # (group, its pages): the short last group of a region
    contiguous: bool  # ``groups`` is a run g0, g0 + 1, ...: one copy to the host


def runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``pages`` as runs of consecutive page numbers: ``[(first, stop), ...]``."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


class DevicePages:
    """Tier-1 parity and page checksums of one store whose pages are on a device."""

    def __init__(self, store: RetainedStore, tier1: ReedSolomonCode | None, pin_parity: bool = True) -> None:
        self.store = store
        self.code = tier1
        self.device = store.pages.device
        self.xor = tier1 is not None and tier1.m == 1 and bool((tier1.matrix[0] == 1).all())
        self._plans: dict[tuple[int, ...], GroupRefresh] = {}
        lay, d = store.layout, store.spec.tier1.data_pages
        most = max(lay.max_chunk_update_pages, 1)
        self.batch_pages = most  # what one ``refresh`` may cover (a chunk; gradients go in such batches)
        n_rows = -(-most // d) + 2 if self.xor else 0  # the groups of a chunk: two may straddle its ends
        self._parity = torch.empty((n_rows, lay.page_bytes), dtype=torch.uint8, device=self.device)
        self._sums = torch.empty(max(most, d), dtype=torch.int64, device=self.device)
        pinned = self.device.type == "cuda"
        self._host_sums = torch.empty(max(most, d), dtype=torch.int64, pin_memory=pinned)
        self._host_rows: torch.Tensor | None = None  # parity computed for a check, copied back
        if pin_parity:  # a trainer, every step; recovery copies little and does not pay for it
            store.pin_host_parity()

    def plan(self, pages: Sequence[int]) -> GroupRefresh:
        key = tuple(pages)
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = self._build(pages)
        return found

    def _build(self, pages: Sequence[int]) -> GroupRefresh:
        t1 = self.store.spec.tier1
        groups = t1.groups_of(pages) if self.code is not None else []
        d = t1.data_pages
        full = [g for g in groups if len(t1.groups[g]) == d]
        index = torch.tensor([t1.groups[g] for g in full], dtype=torch.int64).to(self.device) if full else None
        short = [(g, t1.groups[g]) for g in groups if len(t1.groups[g]) != d]
        contiguous = bool(groups) and groups == list(range(groups[0], groups[0] + len(groups)))
        return GroupRefresh(groups, full, index, short, contiguous)

    def refresh(self, pages: Sequence[int]) -> np.ndarray:
        """Re-encode the tier-1 parity of every group ``pages`` (at most ``batch_pages``, the pages
        of one chunk) belong to into host parity, and return the pages' checksums (int64, as the
        store's table keeps them): one wait for the device, at the end."""
        plan = self.plan(pages)
        store = self.store
        sums = self._sums[: len(pages)]
        at = 0
        for first, stop in runs(pages):
            page_hashes(store.pages[first:stop], out=sums[at : at + stop - first])
            at += stop - first
        host_sums = self._host_sums[: len(pages)]
        host_sums.copy_(sums, non_blocking=True)
        if plan.groups and self.xor:
            self._xor_parity(plan)
        elif plan.groups:
            assert self.code is not None
            for g in plan.groups:  # staged: encoded on the device, the H1 pages copied (synchronous)
                self.code.encode([store.pages[p] for p in store.spec.tier1.groups[g]], list(store.parity1[g]))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return host_sums.numpy().copy()

    def refresh_run(self, first: int, stop: int, group_pages: int) -> np.ndarray:
        """``refresh`` of the pages ``first .. stop - 1`` (a gradient region, whose groups are runs
        of ``group_pages`` pages from ``first``), in batches that fit, group-aligned."""
        step = max(group_pages, self.batch_pages // group_pages * group_pages)
        parts = [self.refresh(range(a, min(a + step, stop))) for a in range(first, stop, step)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def stale_groups(self, groups: Sequence[int]) -> list[int]:
        """Those of ``groups`` whose host parity differs from the XOR of their data pages as they
        are now (``xor`` codes only): computed on the device a buffer at a time, compared on the
        host; nothing is written."""
        store, t1, rows = self.store, self.store.spec.tier1, self._parity
        if self._host_rows is None:
            self._host_rows = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        stale: list[int] = []
        for at in range(0, len(groups), rows.shape[0]):
            batch = list(groups[at : at + rows.shape[0]])
            for i, g in enumerate(batch):
                xor_pages([store.pages[p] for p in t1.groups[g]], rows[i])
            host = self._host_rows[: len(batch)]
            host.copy_(rows[: len(batch)])  # waits for the device
            stale += [g for i, g in enumerate(batch) if not torch.equal(host[i], store.parity1[g, 0])]
        return stale

    def _xor_parity(self, plan: GroupRefresh) -> None:
        store, parity = self.store, self._parity
        rows = {}
        if plan.full_index is not None:
            out = parity[: len(plan.full)]
            xor_groups(store.pages, plan.full_index, out)
            rows.update({g: out[i] for i, g in enumerate(plan.full)})
        for i, (g, members) in enumerate(plan.short):
            row = parity[len(plan.full) + i]
            xor_pages([store.pages[p] for p in members], row)
            rows[g] = row
        if plan.contiguous and not plan.short:
            g0 = plan.groups[0]
            store.parity1[g0 : g0 + len(plan.groups), 0].copy_(parity[: len(plan.groups)], non_blocking=True)
            return
        for g in plan.groups:
            store.parity1[g, 0].copy_(rows[g], non_blocking=True)
