"""Chunk transactions: the crash-consistent optimizer update (DESIGN.md section 2.3).

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

from typing import Callable, Sequence

import torch

from ..faults.points import point
from ..protection.checksum import checksum
from ..protection.codec import ReedSolomonCode
from ..retained.layout import GRAD
from ..retained.store import (
    CHECKSUMMED,
    IDLE,
    MATH_DONE,
    TIER1_DONE,
    TIER2_DONE,
    UNDO_CHUNK,
    UNDO_CRCS,
    UNDO_NPAGES,
    UNDO_NPIECES,
    UNDO_SAVED,
    UNDO_VERSION,
    RetainedStore,
)
from .chunk_math import ChunkPieces, apply_update

PREPARED = "prepared"
COMMITTED = "committed"


def to_i64(value: int) -> int:
    """Store an unsigned 64-bit checksum in an int64 table."""
    return value - (1 << 64) if value >= (1 << 63) else value


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

    def __init__(self, store: RetainedStore, codes: ParityCodes | None = None) -> None:
        self.store = store
        self.layout = store.layout
        self.codes = codes or ParityCodes(store)
        self._scratch = torch.empty(store.layout.page_bytes, dtype=torch.uint8, device=store.pages.device)

    # -- the whole iteration -------------------------------------------------------------
    def run(
        self,
        iteration: int,
        hparams: Sequence[dict],
        payload: object = None,
        skip_params: Sequence[int] = (),
        barrier: Callable[[], None] | None = None,
    ) -> None:
        """Prepare, agree (``barrier``), update every chunk, commit."""
        self.prepare(iteration, hparams, payload, skip_params)
        point("prepare.barrier", iteration=iteration)
        if barrier is not None:
            barrier()
        self.update_chunks(iteration, hparams, skip_params)
        self.commit(iteration, payload)

    def prepare(self, iteration: int, hparams: Sequence[dict], payload: object, skip_params: Sequence[int] = ()) -> None:
        point("prepare.begin", iteration=iteration)
        self.protect_grads()
        point("prepare.grads_protected", iteration=iteration)
        record = {
            "status": PREPARED,
            "iteration": iteration,
            "hparams": [dict(h) for h in hparams],
            "skip_params": sorted(int(i) for i in skip_params),
            "payload": payload,
        }
        self.store.record.write(record)
        point("prepare.recorded", iteration=iteration)

    def update_chunks(self, iteration: int, hparams: Sequence[dict], skip_params: Sequence[int] = (),
                      chunks: Sequence[int] | None = None) -> None:
        skip = frozenset(skip_params)
        versions = self.store.versions()
        for chunk in range(self.layout.n_chunks) if chunks is None else chunks:
            if int(versions[chunk]) == iteration + 1:
                continue  # already committed (roll-forward after a crash)
            self.run_chunk(chunk, iteration, hparams, skip)

    def commit(self, iteration: int, payload: object) -> None:
        point("commit.begin", iteration=iteration)
        self.store.record.write({"status": COMMITTED, "iteration": iteration, "payload": payload})
        point("commit.recorded", iteration=iteration)

    # -- gradients -----------------------------------------------------------------------
    def protect_grads(self) -> None:
        """Checksum the retained gradients and (optionally) re-encode their tier-1 parity."""
        store, lay = self.store, self.layout
        for seg in lay.segments:
            r = lay.region(seg.index, GRAD)
            for p in range(r.first_page, r.first_page + r.n_pages):
                store.crcs[p] = to_i64(checksum(store.pages[p]))
        if self.codes.tier1 is not None and store.config.protect_grads:
            plan = store.spec.tier1
            for g in plan.grad_groups():
                pages = plan.groups[g]
                self.codes.tier1.encode([store.pages[p] for p in pages], list(store.parity1[g]))

    # -- one chunk -----------------------------------------------------------------------
    def run_chunk(self, chunk: int, iteration: int, hparams: Sequence[dict], skip: frozenset = frozenset()) -> None:
        store, lay = self.store, self.layout
        table = store.chunk_table
        if int(table[chunk, 0]) != iteration:
            raise RuntimeError(
                f"chunk {chunk} is at version {int(table[chunk, 0])}, expected {iteration}: retained state is "
                "inconsistent with the update being applied"
            )
        pages = lay.chunk_pages_updated(chunk)
        point("chunk.begin", chunk=chunk, iteration=iteration)
        self._save_undo(chunk, iteration, pages)
        point("chunk.undo_copied", chunk=chunk)
        table[chunk, 1] = UNDO_SAVED
        point("chunk.undo_marked", chunk=chunk)
        seg = lay.segments[int(lay.chunk_segment[chunk])]
        apply_update(lay.family, hparams[seg.group], self._pieces(chunk, skip))
        point("chunk.math_done", chunk=chunk)
        table[chunk, 1] = MATH_DONE
        self._tier1_delta(pages)
        table[chunk, 1] = TIER1_DONE
        point("chunk.tier1_done", chunk=chunk)
        self._tier2_delta(chunk, pages)
        table[chunk, 1] = TIER2_DONE
        point("chunk.tier2_done", chunk=chunk)
        for p in pages:
            store.crcs[p] = to_i64(checksum(store.pages[p]))
        table[chunk, 1] = CHECKSUMMED
        point("chunk.checksummed", chunk=chunk)
        table[chunk, 0] = iteration + 1
        table[chunk, 1] = IDLE
        point("chunk.committed", chunk=chunk)

    def _save_undo(self, chunk: int, iteration: int, pages: list[int]) -> None:
        store, lay = self.store, self.layout
        undo = store.undo_view(len(pages))
        i = 0
        for kind in lay.update_kinds(int(lay.chunk_segment[chunk])):
            rng = lay.chunk_page_range(chunk, kind)
            undo[i : i + len(rng)].copy_(store.pages[rng.start : rng.stop])
            i += len(rng)
        settle(undo)
        first, n_pieces = lay.chunk_first_piece[chunk], len(lay.chunk_pieces[chunk])
        head = store.undo_header
        head[UNDO_CRCS : UNDO_CRCS + len(pages)] = store.crcs[pages]
        steps = head[UNDO_CRCS + len(pages) : UNDO_CRCS + len(pages) + n_pieces].view(torch.float64)
        steps.copy_(store.steps[first : first + n_pieces])
        head[UNDO_NPAGES] = len(pages)
        head[UNDO_NPIECES] = n_pieces
        head[UNDO_VERSION] = iteration
        head[UNDO_CHUNK] = chunk  # written last: the header names a chunk only once complete

    def _pieces(self, chunk: int, skip: frozenset) -> ChunkPieces:
        store, lay = self.store, self.layout
        seg = int(lay.chunk_segment[chunk])
        kinds = lay.update_kinds(seg)
        views = {k: store.chunk_view(chunk, k) for k in kinds}
        grads = store.chunk_view(chunk, GRAD)
        out = ChunkPieces(state={k: [] for k in kinds[1:]})
        first = lay.chunk_first_piece[chunk]
        for i, (param, start, stop) in enumerate(lay.chunk_pieces[chunk]):
            if param in skip:
                continue  # no gradient this iteration: torch.optim leaves the param untouched
            out.params.append(views[kinds[0]][start:stop])
            out.grads.append(grads[start:stop])
            out.steps.append(store.steps[first + i])
            for k in kinds[1:]:
                out.state[k].append(views[k][start:stop])
        return out

    def _tier1_delta(self, pages: list[int]) -> None:
        code = self.codes.tier1
        if code is None:
            return
        store, plan = self.store, self.store.spec.tier1
        undo = store.undo_view(len(pages))
        for i, p in enumerate(pages):
            g = int(plan.page_group[p])
            code.apply_delta(plan.column(p), undo[i], store.pages[p], list(store.parity1[g]), self._scratch)
            if i == 0:
                point("chunk.tier1_partial", page=p)

    def _tier2_delta(self, chunk: int, pages: list[int]) -> None:
        code = self.codes.tier2
        if code is None:
            return
        store, plan = self.store, self.store.spec.tier2
        undo = store.undo_view(len(pages))
        column = store.spec.local_rank
        with store.tier2_lock(chunk):
            for i, p in enumerate(pages):
                stripe = int(plan.page_stripe[p])
                code.apply_delta(column, undo[i], store.pages[p], list(store.parity2[stripe]), self._scratch)
                if i == 0:
                    point("chunk.tier2_partial", page=p)
