"""Bind a model's parameters and a ``torch.optim`` optimizer to retained memory.

After ``RetainedOptimizer.bind`` every ``nn.Parameter``'s data, its ``.grad`` and the
optimizer's state tensors are *views* into the store (zero copies per step), and
``step()`` runs the update as chunk transactions instead of ``optimizer.step()``.

Supported chunk-wise: ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay,
maximize) and ``torch.optim.Adam`` / ``AdamW`` (amsgrad, maximize). Other optimizers are
protected by one whole-state transaction per step (``updater.whole_state``).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from enum import Enum

import torch

from ..env import ProcessSettings
from ..errors import (
    CHECKPOINT_ADVICE,
    ConfigurationError,
    InternalError,
    LetoError,
    RecoveryError,
    UnrecoverableDamageError,
    UsageError,
)
from ..faults.points import point
from ..retained.config import RetainedConfig
from ..retained.layout import GRAD, PARAM, StoreLayout, build_layout
from ..retained.record import ProgressEntry, RecordStatus
from ..retained.shm import new_job_id
from ..retained.store import FLAG_GENERIC_STATE_BOUND, RetainedStore, StoreSpec
from .store_setup import encode_all, no_barrier, set_up_store
from .tier3 import mirror_for
from .transaction import ChunkTransactions, ParityCodes
from .whole_state import UnsupportedOptimizerError, WholeStateTransactions, bind_generic_state, probe_state

__all__ = ["RetainedOptimizer", "UnsupportedOptimizerError", "WindowPhase", "config_for", "layout_for",
           "optimizer_family"]

_FAMILIES = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_UNSUPPORTED_OPTIONS = ("fused", "capturable", "differentiable")


def optimizer_family(optimizer: torch.optim.Optimizer) -> str:
    """'sgd' or 'adam' for the optimizers the chunked path covers exactly, else 'generic'."""
    family = _FAMILIES.get(type(optimizer), "generic")
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


def config_for(config: RetainedConfig, params) -> RetainedConfig:
    """``config`` for these parameters (an optimizer, or an iterable of tensors): ``backend="auto"``
    resolved to where they are (``RetainedConfig.for_device``); mixed devices refused."""
    if config.backend == "cuda":  # no CUDA at all says so first, whatever the params
        from ..retained.backends import cuda_ipc

        cuda_ipc.require_cuda()
    if isinstance(params, torch.optim.Optimizer):
        params = [p for g in params.param_groups for p in g["params"]]
    kinds = {p.device.type for p in params}
    if len(kinds) > 1:
        raise ConfigurationError(f"the parameters are on several kinds of device ({sorted(kinds)}): a rank's retained "
                                 "memory is on one; move the model to one device before binding it")
    return config.for_device(kinds.pop() if kinds else "cpu")


def layout_for(optimizer: torch.optim.Optimizer, config: RetainedConfig, names: dict | None = None,
               whole_state: bool = False) -> StoreLayout:
    """The store layout for ``optimizer``; ``whole_state=True`` forces one whole-state
    transaction per step (its undo copy of everything is what a rollback window restores)."""
    family = "generic" if whole_state else optimizer_family(optimizer)
    if whole_state:
        optimizer_family(optimizer)  # still refuse fused / capturable / differentiable
    names = names or {}
    groups = [[(names.get(p, f"param{j}.{i}"), tuple(p.shape), p.dtype) for i, p in enumerate(g["params"])]
              for j, g in enumerate(optimizer.param_groups)]
    return build_layout(groups, family=family, group_options=hyperparameters(optimizer), page_bytes=config.page_bytes,
                        chunk_pages=config.chunk_pages, generic=probe_state(optimizer) if family == "generic" else None)


class WindowPhase(str, Enum):
    """Where a rollback window (manual optimization) stands; owned by ``RetainedOptimizer``.

    ``SEALED --step()--> OPEN --seal(p)--> SEALED``; ``seal`` while ``SEALED`` only replaces the
    payload of the same iteration; ``resume()`` starts ``SEALED``. ``step()`` while ``OPEN`` is a
    ``UsageError``: every step must be sealed before the next one. Without a rollback window it
    stays ``SEALED``.
    """

    SEALED = "sealed"  # a crash resumes from the last sealed payload and keeps every update
    OPEN = "open"  # a step ran and its iteration is not sealed: a crash rolls it back


class RetainedOptimizer:
    """A torch optimizer whose state and updates live in retained memory.

    ``payload_fn`` returns what a shadow needs to resume (loop position, RNG, ...); it is
    recorded at prepare and becomes the committed progress record.

    ``rollback_window=True`` (manual optimization, where the step runs in the middle of the
    user's code): an iteration's update stays *open* until ``seal(payload)`` -- called where the
    caller can resume after it (the batch end). Until then recovery rolls the update back with
    the whole-state undo copy and resumes from the previous sealed payload, which redoes the
    whole iteration; so every step must be followed by ``seal`` before the next one. Needs a
    whole-state layout (``layout_for(..., whole_state=True)``).

    ``settings``: what the process environment says (``ProcessSettings.from_env()``, read by the
    caller: runtime/ and the integrations); here whether the fused Adam kernel may run.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, store: RetainedStore,
                 barrier: Callable[[], None] | None = None,
                 payload_fn: Callable[[], object] | None = None, rollback_window: bool = False,
                 settings: ProcessSettings | None = None) -> None:
        self.optimizer = optimizer
        self.store = store
        self.layout = store.layout
        self.barrier = barrier
        self.payload_fn = payload_fn
        self.params: list[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        if len(self.params) != len(self.layout.params):
            raise ConfigurationError(f"optimizer has {len(self.params)} params, "
                                     f"the store's layout {len(self.layout.params)}")
        fused = (settings or ProcessSettings()).fused_adam
        if self.layout.family == "generic":
            self.txn: ChunkTransactions = WholeStateTransactions(store, optimizer, self.params, ParityCodes(store),
                                                                 fused_adam=fused)
        else:
            self.txn = ChunkTransactions(store, ParityCodes(store), fused_adam=fused)
        self._received: set[int] = set()
        self._grad_hooks: list = []  # one per param, replaced when bound again (reinitialise)
        self._grad_views = [store.param_view(slot, GRAD) for slot in self.layout.params]  # made once: per step
        self.iteration = 0
        if rollback_window and self.layout.family != "generic":
            raise ConfigurationError("rollback_window needs a whole-state layout: layout_for(..., whole_state=True)")
        self.rollback_window = rollback_window
        self.boundary_payload: object = None  # rollback window: the payload of the last sealed record
        self._before: object = None  # rollback window: the sealed payload the open iteration started from
        self._has_before = False  # a step in this process set _before
        self.window = WindowPhase.SEALED
        if store.config.tier3_parity and (barrier is None or rollback_window):
            raise ConfigurationError("tier3_parity=1 needs the step's agreement across every rank (a barrier; the "
                                     "FSDP2 and data-parallel bindings pass one) and no rollback window")
        self._mirror = mirror_for(store)  # tier 3: after each prepare, the state to the next node

    @classmethod
    def create(cls, optimizer: torch.optim.Optimizer, config: RetainedConfig | None = None, *,
               job_id: str | None = None, rank: int = 0, node: int = 0, local_rank: int = 0, n_local: int = 1,
               settings: ProcessSettings | None = None, **kwargs) -> RetainedOptimizer:
        """Allocate a store for ``optimizer`` (in this process: tests, single-process use).

        ``job_id`` None: a new random one (``new_job_id()``, no prefix: pass
        ``leto_lightning.new_job_id()`` for one that honours ``LETO_JOB_PREFIX``). ``settings``:
        ``RetainedStore.create`` and ``RetainedOptimizer``; the defaults ignore the environment."""
        config = config_for(config or RetainedConfig(), optimizer)
        layout = layout_for(optimizer, config, whole_state=bool(kwargs.get("rollback_window")))
        spec = StoreSpec(job_id or new_job_id(), rank, node, local_rank, n_local, layout, config)

        def bind(store: RetainedStore) -> RetainedOptimizer:
            ro = cls(optimizer, store, settings=settings, **kwargs)
            ro.bind(adopt=False)
            return ro

        # tier 2 spans the node's ranks: completed by the caller once encoded (encode_tier2)
        return set_up_store(spec, bind, barrier=no_barrier, settings=settings,
                            attach_with="RetainedStore.attach", complete=not spec.tier2.enabled,
                            unlink_on_error=True)

    # -- binding -------------------------------------------------------------------------
    def bind(self, adopt: bool, resume: bool = True, iteration: int = 0, payload: object = None) -> None:
        """Make params, grads and optimizer state views into the store.

        ``adopt=False``: copy the current values in and encode fresh parity (a new job).
        ``adopt=True``: the store is authoritative (a shadow resuming): params take its values.
        ``resume=False`` (with adopt): only bind the views -- a shadow pre-initialising while the
        active trainer still trains; call ``resume()`` once promoted.
        ``iteration`` (new store): the first iteration this store will update, e.g. the one after
        a checkpoint; recorded as committed ``iteration - 1`` with ``payload``.

        Raises only ``LetoError``s: ``IncompleteStoreError`` / ``UnrecoverableDamageError`` /
        ``RecoveryError`` when the store cannot be adopted (resume from the checkpoint),
        ``ConfigurationError`` when the model does not fit the store's layout.
        """
        try:
            self._bind(adopt, resume, iteration, payload)
        except LetoError:
            raise
        except OSError as exc:  # the machine refused (shared memory gone, no space): the retained state is unusable
            raise RecoveryError(f"rank {self.store.spec.rank}: could not bind the retained state "
                                f"({type(exc).__name__}: {exc}). {CHECKPOINT_ADVICE}") from exc
        except Exception as exc:  # a bug: it must surface, never pass as "resume from the checkpoint"
            what = "adopt the retained state" if adopt else "initialise the store"
            raise InternalError(f"rank {self.store.spec.rank}: could not {what} ({type(exc).__name__}: {exc}); "
                                "this is a bug in leto-lightning") from exc

    def drop_hooks(self) -> None:
        """The store is being freed: the gradient hooks on the parameters go (each holds this
        object, and through it the store's mappings, for as long as the parameters live)."""
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks.clear()

    def _bind(self, adopt: bool, resume: bool, iteration: int, payload: object) -> None:
        store, lay = self.store, self.layout
        if adopt:
            store.require_complete()  # a half-initialised store holds nothing to adopt
        else:
            store.clear_complete()  # being initialised: incomplete until its creator marks it again
        self.drop_hooks()
        for slot, p in zip(lay.params, self.params):
            if tuple(p.shape) != slot.shape:
                raise ConfigurationError(f"param {slot.name}: shape {tuple(p.shape)} != retained {slot.shape}")
            existing = dict(self.optimizer.state.get(p, {}))  # e.g. loaded from a checkpoint
            view = store.param_view(slot, PARAM)
            if not adopt:
                view.copy_(p.detach())
            p.data = view
            p.grad = self._grad_views[slot.index]
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._mark_received(slot.index)))
            if lay.family != "generic":
                kinds = lay.segments[slot.segment].kinds
                state = {k: store.param_view(slot, k) for k in kinds if k not in (PARAM, GRAD)}
                if lay.family == "adam":
                    state["step"] = store.steps[lay.param_first_piece[slot.index]]
                if not adopt and existing:
                    self._copy_existing_state(slot, state, existing)
                self.optimizer.state[p] = state
        if lay.family == "generic":
            self._bind_generic(adopt)
        if not adopt:
            store.chunk_table[:, 0] = iteration
            encode_all(store, self.txn.codes)
            self.txn.commit(iteration - 1, payload)  # never open: open_records is set by step()
            self.iteration = iteration
            self.boundary_payload = payload
        elif resume:
            self.resume()

    def reinitialise(self, iteration: int, payload: object) -> None:
        """Values were loaded into the bound params and into ``optimizer.state`` (a checkpoint,
        possibly into a running job): initialise the store from them as a new store is
        (``bind(adopt=False)``), committed and closed at ``iteration - 1`` with ``payload``.
        State the optimizer holds no value for starts from zero, as torch's own would; an open
        rollback window is closed (the loaded state replaced what it would roll back). The
        caller encodes tier 2 and marks the store complete."""
        store = self.store
        store.clear_complete()
        base = store.data.untyped_storage().data_ptr()
        for p in self.params:  # state still viewing the store (nothing loaded it): keep its values
            state = self.optimizer.state.get(p)
            if state:
                self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor)
                                           and v.untyped_storage().data_ptr() == base else v
                                           for k, v in state.items()}
        for seg in self.layout.segments:
            for kind in seg.kinds:
                if kind not in (PARAM, GRAD):
                    zero_in_place(store.region_view(seg.index, kind))
        store.steps.zero_()
        store.scalars.zero_()
        store.flags[FLAG_GENERIC_STATE_BOUND] = 0
        open_records, self.txn.open_records = self.txn.open_records, False
        try:
            self.bind(adopt=False, iteration=iteration, payload=payload)
        finally:
            self.txn.open_records = open_records
        self.window, self._has_before, self._before = WindowPhase.SEALED, False, None

    def _copy_existing_state(self, slot, state: dict, existing: dict) -> None:
        """Optimizer state that exists before binding (a checkpoint was loaded) moves in."""
        lay, store = self.layout, self.store
        for key, value in existing.items():
            if key == "step" or key not in state:
                continue
            state[key].copy_(value)
        step = existing.get("step")
        pieces = [i for c, ps in enumerate(lay.chunk_pieces) for i, pc in enumerate(ps, lay.chunk_first_piece[c])
                  if pc[0] == slot.index]
        if step is not None or lay.family == "sgd":
            # SGD keeps no step: a loaded momentum buffer means "not the first step" for every piece.
            value = float(step) if step is not None else 1.0
            store.steps[pieces] = value

    def _bind_generic(self, adopt: bool) -> None:
        """Generic optimizers: bind state that exists (created in ``__init__`` like Adagrad's, or
        retained by an earlier step); state torch creates lazily is adopted after the first step."""
        store = self.store
        if adopt and int(store.flags[FLAG_GENERIC_STATE_BOUND]):
            bind_generic_state(store, self.optimizer, self.params, copy_in=False)
        elif not adopt and all(self.optimizer.state.get(p) for p in self.params):
            bind_generic_state(store, self.optimizer, self.params, copy_in=True)
            store.flags[FLAG_GENERIC_STATE_BOUND] = 1

    def resume(self) -> object:
        """A shadow taking over: finish a prepared whole-state step recovery left pending (it
        needs the optimizer object) and continue after the last committed iteration.
        Returns the committed resume payload (None when nothing was committed yet)."""
        if self.layout.family == "generic":
            # A shadow bound its views before the active trainer's first step created the
            # optimizer state lazily: bind that state now, or the next step would start afresh.
            self._bind_generic(adopt=True)
        rec = self.store.record.read()
        if rec is None:
            raise UnrecoverableDamageError({}, [f"rank {self.store.spec.rank}: segment {self.store.spec.name('meta')}: "
                                                "no intact progress record (both slots fail their checksums)."])
        entry = rec.progress
        if entry.prepared and self.layout.family == "generic":
            self.txn.update_chunks(entry.iteration, entry.hparams, entry.skip_params)
            self.txn.commit(entry.iteration, entry.payload)
            entry = dataclasses.replace(entry, status=RecordStatus.COMMITTED)
        if entry.prepared:
            raise UsageError(f"rank {self.store.spec.rank}: iteration {entry.iteration} is prepared but not "
                             "committed; run updater.recovery.recover_node before binding a shadow")
        if entry.open:
            raise UsageError(f"rank {self.store.spec.rank}: iteration {entry.iteration} is still open (its "
                             "batch never ended); run updater.recovery.recover_node before binding a shadow")
        self.iteration = entry.iteration + 1
        self.boundary_payload = entry.payload
        self.window, self._has_before = WindowPhase.SEALED, False
        return entry.payload

    def _mark_received(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            self._received.add(index)
        return hook

    def mark_received(self, index: int) -> None:
        """Param ``index`` got its gradient this step, written into its retained view by
        something other than autograd's accumulation (FSDP2's reduce-scatter: updater.fsdp2)."""
        self._received.add(index)

    # -- the training-loop API -----------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the retained gradients in place (they stay views); params that then receive no
        gradient are skipped by the next step, as ``torch.optim`` skips ``grad is None``.

        A ``.grad`` something else replaced since the last step (e.g. ``set_to_none`` before
        validation, then a backward whose step was skipped) is dropped: the param points at its
        zeroed view again, so nothing stale accumulates into the next step."""
        for seg in self.layout.segments:
            zero_in_place(self.store.region_view(seg.index, GRAD))
        for p, view in zip(self.params, self._grad_views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        self._received.clear()

    def step(self, closure: Callable | None = None):
        loss = closure() if closure is not None else None
        self._adopt_foreign_grads()
        skip = [i for i in range(len(self.params)) if i not in self._received]
        if self.rollback_window:
            if self.window is WindowPhase.OPEN:
                raise UsageError("one optimizer step per sealed iteration: with a rollback window (manual "
                                   "optimization) call optimizer.step() at most once per training_step")
            self.txn.open_records = True
            payload = self._before = self.boundary_payload  # a rollback resumes here and redoes the step
            self._has_before = True
            self.window = WindowPhase.OPEN
        else:
            payload = self.payload_fn() if self.payload_fn is not None else None
        self.txn.run(self.iteration, hyperparameters(self.optimizer), payload, skip, self.barrier,
                     after_prepare=self._mirror)
        self.iteration += 1
        return loss

    def seal(self, payload: object) -> None:
        """Rollback window: the last step's iteration is complete; a crash from now on resumes
        from ``payload``. Called again for the same iteration (e.g. after validation), it only
        replaces the payload. Keeps the payload to roll back to while a peer is still open."""
        if not self.rollback_window:
            raise UsageError("seal() belongs to a rollback window (RetainedOptimizer(rollback_window=True))")
        point("seal.begin", iteration=self.iteration - 1)
        # With has_before: what a rollback of this iteration resumes from (recovery.roll_back).
        self.store.record.write(ProgressEntry(RecordStatus.COMMITTED, self.iteration - 1, payload,
                                              has_before=self._has_before,
                                              before=self._before if self._has_before else None))
        point("seal.recorded", iteration=self.iteration - 1)
        self.boundary_payload = payload
        self.window = WindowPhase.SEALED

    def record_committed(self, payload: object) -> None:
        """Replace the resume payload of the last committed iteration (same iteration, newer
        payload, e.g. at a batch or epoch boundary; the record's two slots keep the previous
        entry until this write is complete). In a rollback window this seals the iteration
        (``seal``): the batch's update is kept from here on."""
        if self.rollback_window:
            self.seal(payload)
            return
        self.store.record.write(ProgressEntry(RecordStatus.COMMITTED, self.iteration - 1, payload))

    def _adopt_foreign_grads(self) -> None:
        """If something replaced ``p.grad`` (e.g. ``optimizer.zero_grad()`` set it to None and
        autograd made a new tensor), copy it into retained memory and rebind."""
        for slot, p, view in zip(self.layout.params, self.params, self._grad_views):
            if p.grad is None:
                self._received.discard(slot.index)
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
                self._received.add(slot.index)


def zero_in_place(t: torch.Tensor) -> None:
    """``t.zero_()``; a contiguous host tensor through libc's ``memset``, which writes a large
    buffer with non-temporal stores -- without first reading every line into cache as torch's
    fill does (about 2 ms less per 100 MB of gradients here, on every step)."""
    if t.device.type == "cpu" and t.is_contiguous():
        ctypes.memset(t.data_ptr(), 0, t.numel() * t.element_size())
    else:
        t.zero_()
