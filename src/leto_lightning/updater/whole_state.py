"""One whole-state transaction per step, for optimizers without a chunk-wise update.

Any ``torch.optim`` optimizer whose state is per-parameter tensors (shaped like the parameter,
or 0-dim) keeps that state in retained memory and stays protected: its own ``step()`` runs
between a full undo copy and the parity deltas. The price is the memory of a second copy of
params + state (the undo buffer) and one full copy per step -- which is why SGD, Adam and AdamW
take the chunked path instead.

Lazily created state (torch creates it at the first ``step()``) is adopted right after that
step, inside the first transaction.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigurationError, RecoveryError
from ..faults.points import point
from ..retained.layout import GRAD, PARAM, GenericState
from ..retained.spec import words_crc
from ..retained.store import (
    FLAG_GENERIC_STATE_BOUND,
    UNDO_CRCS,
    UNDO_WHOLE,
    ChunkPhase,
    RetainedStore,
)
from .transaction import ChunkTransactions, ParityCodes, settle


class UnsupportedOptimizerError(ConfigurationError, TypeError):
    """The optimizer (or one of its options) cannot keep its state in retained memory."""


def probe_state(optimizer: torch.optim.Optimizer) -> GenericState:
    """The per-element state keys, 0-dim state keys besides 'step' and whether there is a
    'step' of ``optimizer``'s class.

    Found by running the class once on a throwaway parameter: the real optimizer is untouched.
    """
    probe = torch.nn.Parameter(torch.zeros(3))
    probe.grad = torch.full((3,), 0.5)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # defaults may hold keys __init__ does not take (AdamW adds decoupled_weight_decay itself)
    opt = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    opt.step()
    elementwise, scalars = [], []
    for key, value in opt.state[probe].items():
        if isinstance(value, torch.Tensor) and value.shape == probe.shape:
            elementwise.append(key)
        elif isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float32:
            if key != "step":
                scalars.append(key)
        else:
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}: state {key!r} ({type(value).__name__}) cannot live in retained "
                "memory; only per-parameter tensors and float32 scalars can"
            )
    return GenericState(tuple(sorted(elementwise)), tuple(sorted(scalars)), has_step="step" in opt.state[probe])


@dataclass
class WholePlan:
    """The parity side of a whole-state transaction (a ``transaction.ParityDeltas``)."""

    chunk: int
    pages: list[int]
    tier1: list[tuple]
    tier2: list[tuple]


class WholeStateTransactions(ChunkTransactions):
    """Prepare, then undo-copy everything, ``optimizer.step()``, parity deltas, commit."""

    def __init__(self, store: RetainedStore, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                 codes: ParityCodes | None = None, fused_adam: bool = True) -> None:
        super().__init__(store, codes, fused_adam=fused_adam)
        self._plan_cache: WholePlan | None = None
        self.optimizer = optimizer
        self.params = list(params)

    def update_chunks(self, iteration: int, hparams, skip_params=(), chunks=None) -> None:
        store, lay = self.store, self.layout
        versions = store.versions()
        if bool((versions == iteration + 1).all()):
            return
        if not bool((versions == iteration).all()):
            raise RecoveryError(f"whole-state update of iteration {iteration}: chunks at mixed versions "
                                "(retained state inconsistent); resume from the last checkpoint")
        for group, hp in zip(self.optimizer.param_groups, hparams):  # the settings recorded at prepare
            group.update(hp)
        pages = list(lay.update_pages)
        self._save_whole_undo(iteration, pages)
        store.chunk_table[:, 1] = ChunkPhase.UNDO_SAVED
        point("whole.undo_saved", iteration=iteration)
        self._optimizer_step(skip_params)
        point("whole.math_done", iteration=iteration)
        store.chunk_table[:, 1] = ChunkPhase.MATH_DONE
        plan = self._whole_plan()
        if self.device_pages is not None:  # parity re-encoded and pages hashed on the device, chunk by chunk
            sums = None
            for chunk in range(lay.n_chunks):
                done = lay.chunk_pages_updated(chunk)
                self._crcs[done] = self.device_pages.refresh(done)
        else:
            sums = self._tier1_delta(plan)  # the pages' new checksums, taken while in cache
        store.chunk_table[:, 1] = ChunkPhase.TIER1_DONE
        self._tier2_delta(plan)
        store.chunk_table[:, 1] = ChunkPhase.TIER2_DONE
        if self.device_pages is None:
            self._crcs[pages] = sums if sums is not None else store.page_checksums(pages)
        store.chunk_table[:, 1] = ChunkPhase.CHECKSUMMED
        point("whole.checksummed", iteration=iteration)
        store.chunk_table[:, 0] = iteration + 1
        self.meta.seal_all()  # the scalar state, then every chunk's sum: the last one commits
        store.chunk_table[:, 1] = ChunkPhase.IDLE
        point("whole.committed", iteration=iteration)

    def _whole_plan(self) -> WholePlan:
        """Old (undo) and new page of every rewritten page with its parity pages, resolved once.
        The tier-2 lock key ``n_chunks`` is the one every rank's whole-state update takes."""
        if self._plan_cache is None:
            store, lay = self.store, self.layout
            pages = list(lay.update_pages)
            undo = store.undo_view(len(pages))
            t1, t2 = store.spec.tier1, store.spec.tier2
            tier1 = [(undo[i], store.pages[p], t1.column(p), list(store.parity1[int(t1.page_group[p])]))
                     for i, p in enumerate(pages)] if store.parity1.numel() else []
            tier2 = [(undo[i], store.pages[p], list(store.parity2[int(t2.page_stripe[p])]))
                     for i, p in enumerate(pages)] if store.parity2 is not None else []
            self._plan_cache = WholePlan(lay.n_chunks, pages, tier1, tier2)
        return self._plan_cache

    def _optimizer_step(self, skip_params) -> None:
        """torch's own step on the retained views; params without a gradient see ``grad=None``."""
        skip = set(skip_params)
        saved = {}
        for i in skip:
            saved[i], self.params[i].grad = self.params[i].grad, None
        try:
            self.optimizer.step()
        finally:
            for i, g in saved.items():
                self.params[i].grad = g
        # Adopt state torch created lazily at this first step, and any state tensor the optimizer
        # replaced instead of updating in place: retained memory must hold the live values.
        bind_generic_state(self.store, self.optimizer, self.params, copy_in=True)
        self.store.flags[FLAG_GENERIC_STATE_BOUND] = 1

    def _save_whole_undo(self, iteration: int, pages: list[int]) -> None:
        store, lay = self.store, self.layout
        undo = store.undo_view(len(pages))
        i = 0
        for r in lay.regions:
            if r.kind != GRAD:
                undo[i : i + r.n_pages].copy_(store.pages[r.first_page : r.first_page + r.n_pages])
                i += r.n_pages
        tail = whole_undo_tail(store)
        tail["crcs"].copy_(store.crcs[pages])
        tail["steps"].copy_(store.steps)
        tail["scalars"].copy_(store.scalars.flatten())
        tail["flags"].copy_(store.flags)
        settle(undo)
        head = self._head
        head[:] = 0
        head[:UNDO_CRCS] = (UNDO_WHOLE, iteration, len(pages), lay.n_pieces)
        head[-1] = tail_crc(store)  # the backups in the undo tail are checked before a restore uses them
        self.meta.write_header(head)


def whole_undo_tail(store: RetainedStore) -> dict[str, torch.Tensor]:
    """Backups of checksums, step counters and scalar state, after the pages in the undo buffer."""
    lay = store.layout
    n = len(lay.update_pages)
    words = store.undo[n * lay.page_bytes :].view(torch.int64)
    n_scalars = store.scalars.numel()
    return {
        "crcs": words[:n],
        "steps": words[n : n + lay.n_pieces].view(torch.float64),
        "scalars": words[n + lay.n_pieces : n + lay.n_pieces + n_scalars].view(torch.float64),
        "flags": words[n + lay.n_pieces + n_scalars : n + lay.n_pieces + n_scalars + store.flags.numel()],
    }


def tail_crc(store: RetainedStore) -> int:
    """Checksum of the undo tail's backups (read back to the host: the tail is on the device with "cuda")."""
    tail = {k: v.cpu().numpy() for k, v in whole_undo_tail(store).items()}
    return words_crc(UNDO_WHOLE, tail["crcs"], tail["steps"], tail["scalars"], tail["flags"])


def restore_whole(store: RetainedStore, version: int) -> list[int]:
    """Put back everything a whole-state transaction at ``version`` may have touched (the header
    was checked by the caller, the tail is checked here); returns the pages."""
    lay = store.layout
    pages = list(lay.update_pages)
    undo = store.undo_view(len(pages))
    for i, p in enumerate(pages):
        store.pages[p].copy_(undo[i])
    tail = whole_undo_tail(store)
    store.crcs[pages] = tail["crcs"].to(store.crcs.device, copy=True)  # the tail is on the device with "cuda"
    store.steps.copy_(tail["steps"].float())
    store.scalars.copy_(tail["scalars"].float().view_as(store.scalars))
    store.flags.copy_(tail["flags"])  # e.g. "state adopted" set by the step being undone
    store.chunk_table[:, 0] = version
    store.chunk_table[:, 1] = ChunkPhase.IDLE
    return pages


def bind_generic_state(store: RetainedStore, optimizer: torch.optim.Optimizer,
                       params: Sequence[torch.nn.Parameter], copy_in: bool) -> None:
    """Make the optimizer's state tensors views into the store (``copy_in``: keep its values)."""
    lay = store.layout
    for slot, p in zip(lay.params, params):
        existing = optimizer.state.get(p, {})
        state = {}
        for kind in lay.segments[slot.segment].kinds:
            if kind in (PARAM, GRAD):
                continue
            state[kind] = store.param_view(slot, kind)
        if lay.generic is not None and lay.generic.has_step:
            state["step"] = store.steps[lay.param_first_piece[slot.index]]
        for j, kind in enumerate(lay.scalar_kinds):
            state[kind] = store.scalars[slot.index, j]
        if copy_in:  # keep the optimizer's values; skip tensors that already are our views
            for key, view in state.items():
                if key in existing and existing[key].data_ptr() != view.data_ptr():
                    view.copy_(existing[key])
        optimizer.state[p] = state
