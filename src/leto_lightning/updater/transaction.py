"""Chunk transactions: the crash-consistent optimizer update (docs/design.md section 2.3).

Iteration ``t`` moves every chunk from version ``t`` to ``t + 1``:

1. ``prepare``: the gradients of ``t`` are final in retained memory; record their checksums,
   re-encode their tier-1 parity, and write the progress record ``prepared(t)`` carrying the
   hyper-parameters of ``t`` (so a roll-forward redoes exactly this step) and the caller's
   resume payload. The caller then runs its cross-rank agreement (``barrier``): no chunk of
   ``t`` commits before every rank is prepared.
2. per chunk: undo copy -> math -> tier-1 parity delta -> tier-2 parity delta -> checksums ->
   commit mark (version ``t + 1``). The phase column of the chunk table says how far it got.
3. ``commit``: progress record ``committed(t)``.

A SIGKILL anywhere leaves memory that ``recovery.recover_rank`` can bring to a state
bit-identical to an uninterrupted update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import RecoveryError
from ..faults.points import point
from ..protection.checksum import CHECKSUM_ALGORITHM, checksum
from ..protection.codec import ReedSolomonCode
from ..retained.integrity import Metadata
from ..retained.layout import GRAD, PARAM
from ..retained.record import ProgressEntry, RecordStatus
from ..retained.store import (
    UNDO_CRCS,
    ChunkPhase,
    RetainedStore,
    to_i64,
)
from . import fused_adam
from .chunk_math import ChunkPieces, apply_update
from .device_pages import DevicePages
from .fused_adam import switched_off as fused_adam_off


def settle(tensor: torch.Tensor) -> None:
    """Wait until the device has finished writing ``tensor`` (a no-op on CPU).

    Why: marks in host memory (chunk phases, the undo header) take effect at once, while device
    copies are only queued -- and a SIGKILLed process's queued work may never run. A mark must
    not claim a copy the device has not finished. (Checksums read device pages back to the host,
    which waits by itself, so commit marks need no extra wait.)
    """
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


class ParityCodes:
    """The two Reed-Solomon codes of a store: tier 1 (D + H1) and tier 2 (devices + H2)."""

    def __init__(self, store: RetainedStore) -> None:
        cfg, spec = store.config, store.spec
        self.tier1 = ReedSolomonCode(cfg.data_pages, cfg.tier1_parity, cfg.engine) if cfg.tier1_parity else None
        self.tier2 = ReedSolomonCode(spec.n_local, cfg.tier2_parity, cfg.engine) if spec.tier2.enabled else None


class ChunkTransactions:
    """Runs optimizer updates on a ``RetainedStore`` as chunk transactions."""

    def __init__(self, store: RetainedStore, codes: ParityCodes | None = None, pin_parity: bool = True,
                 fused_adam: bool = True) -> None:
        """``fused_adam``: the fused kernel may run (``ProcessSettings.fused_adam``, i.e. not
        ``LETO_FUSED_ADAM=0``); False keeps every chunk on torch's math and the codec's encode."""
        self.store = store
        self._fused_adam = fused_adam
        if not fused_adam:
            fused_adam_off()  # says so in the log, once
        self.layout = store.layout
        self.codes = codes or ParityCodes(store)
        code = self.codes.tier1
        # Tier 1 has one parity page per group, the XOR of its data pages: the fused Adam kernel
        # folds deltas into such pages itself, and encodes the gradients' with their checksums.
        self._xor_tier1 = code is not None and code.m == 1 and bool((code.matrix[0] == 1).all())
        # Pages on a device (or hashed as if they were): parity re-encoded and pages hashed there.
        self.device_pages = DevicePages(store, code, pin_parity) if store.hashes_on_device else None
        self._crc64 = store.checksum_algorithm == CHECKSUM_ALGORITHM  # what the fused kernel computes
        self._scratch = torch.empty(store.layout.page_bytes, dtype=torch.uint8, device=store.pages.device)
        # Host metadata through numpy: a torch __setitem__ costs microseconds, per chunk many times.
        self._table = store.chunk_table.numpy()
        self._crcs = store.crcs.numpy()
        self._steps = store.steps.numpy()
        self._progress = store.undo_progress.numpy()
        self.meta = Metadata(store)
        self._head = np.zeros(store.spec.undo_header_words, dtype=np.int64)  # the next undo header, built here
        self._plans: dict[int, ChunkPlan] = {}
        # Rollback window (manual optimization): records of an iteration stay "open" until the
        # caller seals it; recovery rolls an open iteration back instead of forward.
        self.open_records = False

    # -- the whole iteration -------------------------------------------------------------
    def run(
        self,
        iteration: int,
        hparams: Sequence[dict],
        payload: object = None,
        skip_params: Sequence[int] = (),
        barrier: Callable[[], None] | None = None,
        after_prepare: Callable[[int], None] | None = None,
    ) -> None:
        """Prepare, ``after_prepare`` (tier 3: the prepared state to the next node), agree
        (``barrier``), update every chunk, commit."""
        self.prepare(iteration, hparams, payload, skip_params)
        if after_prepare is not None:
            after_prepare(iteration)
        point("prepare.barrier", iteration=iteration)
        if barrier is not None:
            barrier()
        self.update_chunks(iteration, hparams, skip_params)
        self.commit(iteration, payload)

    def prepare(self, iteration: int, hparams: Sequence[dict], payload: object,
                skip_params: Sequence[int] = ()) -> None:
        point("prepare.begin", iteration=iteration)
        self.protect_grads()
        point("prepare.grads_protected", iteration=iteration)
        self.store.record.write(ProgressEntry(
            RecordStatus.PREPARED, iteration, payload, hparams=tuple(dict(h) for h in hparams),
            skip_params=tuple(sorted(int(i) for i in skip_params)), open=self.open_records))
        point("prepare.recorded", iteration=iteration)

    def update_chunks(self, iteration: int, hparams: Sequence[dict], skip_params: Sequence[int] = (),
                      chunks: Sequence[int] | None = None) -> None:
        skip = frozenset(skip_params)
        versions = self._table[:, 0]
        for chunk in range(self.layout.n_chunks) if chunks is None else chunks:
            if versions[chunk] == iteration + 1:
                continue  # already committed (roll-forward after a crash)
            self.run_chunk(chunk, iteration, hparams, skip)

    def commit(self, iteration: int, payload: object) -> None:
        point("commit.begin", iteration=iteration)
        self.store.record.write(ProgressEntry(RecordStatus.COMMITTED, iteration, payload, open=self.open_records))
        point("commit.recorded", iteration=iteration)

    # -- gradients -----------------------------------------------------------------------
    def protect_grads(self) -> None:
        """Checksum the retained gradients and (optionally) re-encode their tier-1 parity; with
        the fused kernel and XOR parity both in one read of each page (``Kernel.encode_xor``),
        on a device both there (``DevicePages``)."""
        store, lay, crcs = self.store, self.layout, self._crcs
        if self.device_pages is not None:
            for seg in lay.segments:
                if GRAD in seg.kinds:
                    r = lay.region(seg.index, GRAD)
                    crcs[r.first_page : r.first_page + r.n_pages] = self.device_pages.refresh_run(
                        r.first_page, r.first_page + r.n_pages, store.spec.tier1.data_pages)
            self.meta.seal_grads()
            return
        done: set[int] = set()  # pages the kernel already checksummed
        if self.codes.tier1 is not None and store.config.protect_grads:
            plan = store.spec.tier1
            kernel = fused_adam.kernel() if self._fused_adam and self._xor_tier1 and self._crc64 else None
            for g in plan.grad_groups():
                pages = plan.groups[g]
                if kernel is None:
                    self.codes.tier1.encode([store.pages[p] for p in pages], list(store.parity1[g]))
                    continue
                sums = kernel.encode_xor([store.pages[p] for p in pages], store.parity1[g][0])
                crcs[list(pages)] = [to_i64(c) for c in sums]
                done.update(pages)
        for seg in lay.segments:
            r = lay.region(seg.index, GRAD)
            todo = [p for p in range(r.first_page, r.first_page + r.n_pages) if p not in done]
            crcs[todo] = store.page_checksums(todo)
        self.meta.seal_grads()

    # -- one chunk -----------------------------------------------------------------------
    def run_chunk(self, chunk: int, iteration: int, hparams: Sequence[dict], skip: frozenset = frozenset()) -> None:
        lay = self.layout
        table = self._table
        if table[chunk, 0] != iteration:
            raise RecoveryError(
                f"chunk {chunk} is at version {int(table[chunk, 0])}, expected {iteration}: retained state is "
                "inconsistent with the update being applied"
            )
        plan = self._plan(chunk)
        fits = self._fused_adam and plan.fused is not None and self._crc64 and fused_adam.covers(hparams[plan.group])
        kernel = fused_adam.kernel() if fits else None
        point("chunk.begin", chunk=chunk, iteration=iteration)
        self._save_undo(plan, iteration, copy=kernel is None)  # the kernel saves it block by block
        point("chunk.undo_copied", chunk=chunk)
        table[chunk, 1] = ChunkPhase.UNDO_SAVED
        point("chunk.undo_marked", chunk=chunk)
        sums: Sequence[int] | np.ndarray | None
        if kernel is None:
            apply_update(lay.family, hparams[plan.group], plan.pieces_for(skip))
            point("chunk.math_done", chunk=chunk)
            table[chunk, 1] = ChunkPhase.MATH_DONE
            if self.device_pages is not None:  # parity re-encoded and pages hashed on the device
                sums = self.device_pages.refresh(plan.pages)
                point("chunk.tier1_partial", page=plan.pages[0])
            else:
                sums = self._tier1_delta(plan)
        else:
            sums = self._fused_update(plan, kernel, hparams[plan.group], skip)
        table[chunk, 1] = ChunkPhase.TIER1_DONE
        point("chunk.tier1_done", chunk=chunk)
        self._tier2_delta(plan)
        table[chunk, 1] = ChunkPhase.TIER2_DONE
        point("chunk.tier2_done", chunk=chunk)
        self._crcs[plan.pages] = sums if sums is not None else self.store.page_checksums(plan.pages)
        table[chunk, 1] = ChunkPhase.CHECKSUMMED
        point("chunk.checksummed", chunk=chunk)
        table[chunk, 0] = iteration + 1
        self.meta.seal_chunk(chunk)  # the commit point: the chunk's checksummed metadata at t + 1
        table[chunk, 1] = ChunkPhase.IDLE
        point("chunk.committed", chunk=chunk)
        self.meta.mirror_chunk(chunk)

    def _plan(self, chunk: int) -> ChunkPlan:
        plan = self._plans.get(chunk)
        if plan is None:
            plan = self._plans[chunk] = ChunkPlan.build(self.store, chunk, self._xor_tier1)
        return plan

    def _save_undo(self, plan: ChunkPlan, iteration: int, copy: bool = True) -> None:
        """The undo header, after the undo copy (``copy``) or before the fused kernel makes it
        (``progress`` 0: nothing of the chunk is modified yet)."""
        store = self.store
        if copy:
            for dst, src in plan.undo_copies:
                dst.copy_(src)
            settle(plan.undo_pages[0] if plan.undo_pages else store.undo)
        self._progress[0] = -1 if copy else 0  # before the header: it applies to the chunk the header names
        n_pages, n_pieces, first = len(plan.pages), plan.n_pieces, plan.first_piece
        head = self._head
        head[:] = 0
        head[:UNDO_CRCS] = (plan.chunk, iteration, n_pages, n_pieces)
        head[UNDO_CRCS : UNDO_CRCS + n_pages] = self._crcs[plan.pages]
        steps_saved = head[UNDO_CRCS + n_pages : UNDO_CRCS + n_pages + n_pieces]
        steps_saved.view(np.float64)[:] = self._steps[first : first + n_pieces]
        point("chunk.undo_pages_copied", chunk=plan.chunk)
        self.meta.write_header(head)  # both checksummed copies: from here on the chunk is in flight

    def _fused_update(self, plan: ChunkPlan, kernel: fused_adam.Kernel, hp: dict, skip: frozenset) -> np.ndarray:
        """Undo copy, Adam's math, the tier-1 delta and the new checksums in one pass over the
        chunk (``fused_adam``), the same bits as the unfused steps. Recovery restores the bytes
        the kernel saved (``progress``) and re-checks parity whatever the phase a crash hit."""
        assert plan.fused is not None
        pieces = [j for j, piece in enumerate(plan.pieces) if piece[0] not in skip]
        rows = np.empty((len(pieces), fused_adam.HP_FIELDS), dtype=np.float32)
        steps = self._steps
        for r, j in enumerate(pieces):
            steps[plan.first_piece + j] += 1  # as torch: step_t += 1 (float32), then its value
            rows[r] = fused_adam.piece_hparams(hp, float(steps[plan.first_piece + j]))
        ranges = None if len(pieces) == plan.n_pieces else plan.fused.pieces[pieces]
        crcs = np.zeros(len(plan.pages), dtype=np.uint64)
        end = plan.fused.page_elems * plan.fused.n_pages
        if plan.fused.parity is None:  # no tier 1, or H1 > 1: the codec folds the deltas below
            plan.fused.run(kernel, 0, end, rows, ranges, crcs, self._progress)
        else:  # the kernel folds them: its mid-parity point is half a page in
            half = plan.fused.page_elems // 2
            plan.fused.run(kernel, 0, half, rows, ranges, crcs, self._progress)
            point("chunk.tier1_partial", page=plan.pages[0])
            plan.fused.run(kernel, half, end, rows, ranges, crcs, self._progress)
        point("chunk.math_done", chunk=plan.chunk)
        self._table[plan.chunk, 1] = ChunkPhase.MATH_DONE
        if plan.fused.parity is None:
            self._tier1_delta(plan, checksums=False)
        return crcs.view(np.int64)  # the checksums as the int64 table stores them (to_i64)

    def _tier1_delta(self, plan: ParityDeltas, checksums: bool = True) -> list[int] | None:
        """Fold each page's change into its tier-1 parity; returns the pages' new checksums
        (None without tier 1). Why here: a page is final once the math is done, and checksumming
        it right after its delta reads it while it is still in cache (a separate pass later read
        every page of the chunk from memory again). The caller records them at the same protocol
        point as before (after the tier-2 delta, before the commit mark). ``checksums`` False:
        the fused kernel has them already."""
        code = self.codes.tier1
        if code is None or not plan.tier1:
            return None
        sums = []
        for i, (old, new, column, parity) in enumerate(plan.tier1):
            code.apply_delta(column, old, new, parity, self._scratch)
            if checksums:
                sums.append(to_i64(checksum(new, self.store.checksum_algorithm)))
            if i == 0:
                point("chunk.tier1_partial", page=plan.pages[0])
        return sums

    def _tier2_delta(self, plan: ParityDeltas) -> None:
        code = self.codes.tier2
        if code is None:
            return
        column = self.store.spec.local_rank
        with self.store.tier2_lock(plan.chunk):
            for i, (old, new, parity) in enumerate(plan.tier2):
                code.apply_delta(column, old, new, parity, self._scratch)
                if i == 0:
                    point("chunk.tier2_partial", page=plan.pages[0])


class ParityDeltas(Protocol):
    """What the parity deltas of a transaction need: ``ChunkPlan``, or the whole-state plan."""

    chunk: int  # the tier-2 lock key
    pages: list[int]
    tier1: list[tuple]  # (old, new, column, parity pages) per page
    tier2: list[tuple]  # (old, new, parity pages) per page


@dataclass
class ChunkPlan:
    """Everything one chunk transaction touches, resolved once: page and undo views, the parity
    pages of each page, the optimizer pieces. Rebuilding these per step cost ~0.4 ms a chunk."""

    chunk: int
    group: int
    pages: list[int]
    page_tensors: list[torch.Tensor]
    undo_pages: list[torch.Tensor]
    undo_copies: list[tuple[torch.Tensor, torch.Tensor]]
    tier1: list[tuple]
    tier2: list[tuple]
    first_piece: int
    n_pieces: int
    pieces: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, dict]]
    state_kinds: tuple[str, ...]
    fused: fused_adam.FusedChunk | None = None  # the one-pass Adam kernel's view, where it applies
    _all: ChunkPieces | None = None

    @classmethod
    def build(cls, store: RetainedStore, chunk: int, xor_row: bool = False) -> ChunkPlan:
        """``xor_row``: tier 1 has one parity page per group, the XOR of its data pages (the
        fused Adam kernel folds deltas into such pages itself)."""
        lay = store.layout
        seg = int(lay.chunk_segment[chunk])
        kinds = lay.update_kinds(seg)
        pages = lay.chunk_pages_updated(chunk)
        undo = store.undo_view(len(pages))
        copies, i = [], 0
        for kind in kinds:
            rng = lay.chunk_page_range(chunk, kind)
            copies.append((undo[i : i + len(rng)], store.pages[rng.start : rng.stop]))
            i += len(rng)
        t1plan, t2plan = store.spec.tier1, store.spec.tier2
        tier1 = [(undo[i], store.pages[p], t1plan.column(p), list(store.parity1[int(t1plan.page_group[p])]))
                 for i, p in enumerate(pages)] if store.parity1.numel() else []
        tier2 = [(undo[i], store.pages[p], list(store.parity2[int(t2plan.page_stripe[p])]))
                 for i, p in enumerate(pages)] if store.parity2 is not None else []
        views = {k: store.chunk_view(chunk, k) for k in kinds}
        grads = store.chunk_view(chunk, GRAD)
        first = lay.chunk_first_piece[chunk]
        pieces = [(param, views[kinds[0]][a:b], grads[a:b], store.steps[first + j],
                   {k: views[k][a:b] for k in kinds[1:]})
                  for j, (param, a, b) in enumerate(lay.chunk_pieces[chunk])]
        page_tensors, undo_pages = [store.pages[p] for p in pages], [undo[i] for i in range(len(pages))]
        fused = None
        if lay.family == "adam" and kinds == (PARAM, "exp_avg", "exp_avg_sq") and store.pages.device.type == "cpu":
            fused = fused_adam.build_fused_chunk(page_tensors, undo_pages, grads,
                                                 [t[3] for t in tier1] if tier1 and xor_row else None,
                                                 [(a, b) for _, a, b in lay.chunk_pieces[chunk]])
        return cls(chunk, lay.segments[seg].group, pages, page_tensors, undo_pages, copies, tier1, tier2, first,
                   len(pieces), pieces, kinds[1:], fused)

    def pieces_for(self, skip: frozenset) -> ChunkPieces:
        """The optimizer's view of the chunk; params without a gradient this step left out."""
        if not skip and self._all is not None:
            return self._all
        out = ChunkPieces(state={k: [] for k in self.state_kinds})
        for param, p, g, step, state in self.pieces:
            if param in skip:
                continue  # no gradient this iteration: torch.optim leaves the param untouched
            out.params.append(p)
            out.grads.append(g)
            out.steps.append(step)
            for k in self.state_kinds:
                out.state[k].append(state[k])
        if not skip:
            self._all = out
        return out
