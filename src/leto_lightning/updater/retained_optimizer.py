"""Bind a model's parameters and a ``torch.optim`` optimizer to retained memory.

After ``RetainedOptimizer.bind`` every ``nn.Parameter``'s data, its ``.grad`` and the
optimizer's state tensors are *views* into the store (zero copies per step), and
``step()`` runs the update as chunk transactions instead of ``optimizer.step()``.

Supported chunk-wise: ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay,
maximize) and ``torch.optim.Adam`` / ``AdamW`` (amsgrad, maximize). Other optimizers are
refused here; ``updater.whole_state`` protects them with one whole-state transaction.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..retained.config import RetainedConfig
from ..retained.layout import GRAD, PARAM, StoreLayout, build_layout
from ..retained.store import RetainedStore, StoreSpec
from ..retained.shm import new_job_id
from .transaction import COMMITTED, ChunkTransactions, ParityCodes

_FAMILIES = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_UNSUPPORTED_OPTIONS = ("fused", "capturable", "differentiable")


class UnsupportedOptimizerError(TypeError):
    pass


def optimizer_family(optimizer: torch.optim.Optimizer) -> str:
    """'sgd' or 'adam' for the optimizers the chunked path covers exactly."""
    family = _FAMILIES.get(type(optimizer))
    if family is None:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} has no chunk-wise update; use the whole-state transaction "
            "(leto_lightning.updater.whole_state) or one of SGD, Adam, AdamW"
        )
    for group in optimizer.param_groups:
        for opt in _UNSUPPORTED_OPTIONS:
            if group.get(opt):
                raise UnsupportedOptimizerError(f"{type(optimizer).__name__}({opt}=True) is not supported chunk-wise")
    return family


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups' settings as plain values, as recorded at prepare."""
    out = []
    for group in optimizer.param_groups:
        hp = {k: v for k, v in group.items() if k != "params"}
        hp = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in hp.items()}
        out.append(hp)
    return out


def layout_for(optimizer: torch.optim.Optimizer, config: RetainedConfig, names: dict | None = None) -> StoreLayout:
    family = optimizer_family(optimizer)
    names = names or {}
    groups = [[(names.get(p, f"param{j}.{i}"), tuple(p.shape), p.dtype) for i, p in enumerate(g["params"])]
              for j, g in enumerate(optimizer.param_groups)]
    return build_layout(groups, family=family, group_options=hyperparameters(optimizer),
                        page_bytes=config.page_bytes, chunk_pages=config.chunk_pages)


class RetainedOptimizer:
    """A torch optimizer whose state and updates live in retained memory.

    ``payload_fn`` returns what a shadow needs to resume (loop position, RNG, ...); it is
    recorded at prepare and becomes the committed progress record.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, store: RetainedStore,
                 barrier: Callable[[], None] | None = None,
                 payload_fn: Callable[[], object] | None = None) -> None:
        self.optimizer = optimizer
        self.store = store
        self.layout = store.layout
        self.barrier = barrier
        self.payload_fn = payload_fn
        self.params: list[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        if len(self.params) != len(self.layout.params):
            raise ValueError(f"optimizer has {len(self.params)} params, the store's layout {len(self.layout.params)}")
        self.txn = ChunkTransactions(store, ParityCodes(store))
        self._received: set[int] = set()
        self.iteration = 0

    @classmethod
    def create(cls, optimizer: torch.optim.Optimizer, config: RetainedConfig | None = None, *,
               job_id: str | None = None, rank: int = 0, node: int = 0, local_rank: int = 0, n_local: int = 1,
               **kwargs) -> "RetainedOptimizer":
        """Allocate a store for ``optimizer`` (in this process: tests, single-process use)."""
        config = config or RetainedConfig()
        spec = StoreSpec(job_id or new_job_id(), rank, node, local_rank, n_local, layout_for(optimizer, config), config)
        store = RetainedStore.create(spec)
        ro = cls(optimizer, store, **kwargs)
        ro.bind(adopt=False)
        return ro

    # -- binding -------------------------------------------------------------------------
    def bind(self, adopt: bool) -> None:
        """Make params, grads and optimizer state views into the store.

        ``adopt=False``: copy the current values in and encode fresh parity (a new job).
        ``adopt=True``: the store is authoritative (a shadow resuming): params take its values.
        """
        store, lay = self.store, self.layout
        for slot, p in zip(lay.params, self.params):
            if tuple(p.shape) != slot.shape:
                raise ValueError(f"param {slot.name}: shape {tuple(p.shape)} != retained {slot.shape}")
            view = store.param_view(slot, PARAM)
            if not adopt:
                view.copy_(p.detach())
            p.data = view
            p.grad = store.param_view(slot, GRAD)
            p.register_post_accumulate_grad_hook(self._mark_received(slot.index))
            state = {k: store.param_view(slot, k) for k in lay.segments[slot.segment].kinds if k not in (PARAM, GRAD)}
            if lay.family == "adam":
                state["step"] = store.steps[lay.param_first_piece[slot.index]]
            self.optimizer.state[p] = state
        if not adopt:
            self._load_existing_state()
            encode_all(store, self.txn.codes)
        else:
            rec = store.record.read()
            self.iteration = 0 if rec is None else rec.payload["iteration"] + (rec.payload["status"] == COMMITTED)

    def _mark_received(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            self._received.add(index)
        return hook

    def _load_existing_state(self) -> None:
        """Nothing to copy for a fresh optimizer; state loaded before binding is not supported yet."""

    # -- the training-loop API -----------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the retained gradients in place (they stay views); params that then receive no
        gradient are skipped by the next step, as ``torch.optim`` skips ``grad is None``."""
        for seg in self.layout.segments:
            self.store.region_view(seg.index, GRAD).zero_()
        self._received.clear()

    def step(self, closure: Callable | None = None):
        loss = closure() if closure is not None else None
        self._adopt_foreign_grads()
        skip = [i for i in range(len(self.params)) if i not in self._received]
        payload = self.payload_fn() if self.payload_fn is not None else None
        self.txn.run(self.iteration, hyperparameters(self.optimizer), payload, skip, self.barrier)
        self.iteration += 1
        return loss

    def _adopt_foreign_grads(self) -> None:
        """If something replaced ``p.grad`` (e.g. ``optimizer.zero_grad()`` set it to None and
        autograd made a new tensor), copy it into retained memory and rebind."""
        for slot, p in zip(self.layout.params, self.params):
            view = self.store.param_view(slot, GRAD)
            if p.grad is None:
                self._received.discard(slot.index)
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
                self._received.add(slot.index)


def encode_all(store: RetainedStore, codes: ParityCodes) -> None:
    """Checksum every page and encode all parity from scratch (a new store)."""
    from ..protection.checksum import checksum
    from .transaction import to_i64

    for p in range(store.layout.n_pages):
        store.crcs[p] = to_i64(checksum(store.pages[p]))
    plan = store.spec.tier1
    if codes.tier1 is not None:
        for g, pages in enumerate(plan.groups):
            codes.tier1.encode([store.pages[p] for p in pages], list(store.parity1[g]))


def encode_tier2(stores: Sequence[RetainedStore], codes: ParityCodes) -> None:
    """Encode the node's tier-2 stripes from every local rank's pages (after all are bound)."""
    if codes.tier2 is None:
        return
    first = stores[0]
    for p, s in enumerate(first.spec.tier2.page_stripe):
        if s >= 0:
            codes.tier2.encode([st.pages[p] for st in stores], list(first.parity2[int(s)]))
