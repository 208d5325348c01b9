"""The trainer-side engine: the one object a protected training process holds.

Plain PyTorch (``Session.protect`` -> ``ProtectedTraining``), both Lightning strategies and
``LetoAccelerator`` each hold one ``TrainerEngine`` and delegate to it; what differs between
them is only how the framework hands over the optimizer, the model and the resume payload.
The engine owns, once for all of them:

- the **run mode** (``RunMode``): a fresh store, one restored from a checkpoint, or retained
  memory continued -- by a promoted shadow or by a process restarted on it;
- the **retained binding** (``bound``: replicated, ZeRO-1 or whole-state; ``sharded``: the
  FSDP2 local shards) and its one **set-up routine** (``updater.store_setup.set_up_store``:
  create, bind, encode tier 1 and tier 2, mark complete -- then shadows are told they may
  attach) or its attach-and-resume counterpart;
- the **step protocol**: the agent hears "update" once the closure (forward, backward,
  clipping) ran, the chunk transactions run, the optimizer is marked stepped for LR
  schedulers, the agent hears "done" (and the first completed iteration of a generation);
- the **trainer's side of the agent protocol** (``link``: a ``RuntimeLink`` under ``leto
  launch``, None otherwise) -- heartbeats, resumed, exception, finished;
- the **end**: the store's mappings dropped, and the memory freed when nothing will resume.

Modelled on torchft's ``Manager``: the integration calls the engine at its framework's hooks;
the engine never calls into the framework (the payload comes from callbacks it is given).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

import torch

from ..env import ProcessSettings, job_prefix
from ..errors import UsageError
from ..faults.points import point
from ..retained.config import RetainedConfig
from ..retained.shm import new_job_id
from ..retained.store import RetainedStore, StoreSpec
from ..retained.torch_internals import mark_optimizer_stepped
from ..updater.fsdp2 import RetainedFSDP2, attach_fsdp2, create_fsdp2
from ..updater.retained_optimizer import RetainedOptimizer, config_for, layout_for
from ..updater.store_setup import complete_new_store, encode_all, set_up_store
from .link import RuntimeLink
from .messages import TrainerPhase

log = logging.getLogger(__name__)
Binding = TypeVar("Binding", bound=RetainedOptimizer)


def agreed_new_job_id(world_size: int) -> str:
    """A fresh job id, the same on every rank (rank 0's, over the process group when there is
    one): tier 2 attaches the peers' stores by it."""
    job = [new_job_id(job_prefix())]
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(job, src=0)
    return job[0]


class RunMode(Enum):
    """How this process's retained state came about (set when it binds; transitions:
    ``UNBOUND -> FRESH | FROM_CHECKPOINT`` on create, ``UNBOUND -> RESTARTED | PROMOTED`` on
    attach, any -> ``UNBOUND`` on release)."""

    UNBOUND = "unbound"
    FRESH = "fresh"  # a new store from the model's own initial values
    FROM_CHECKPOINT = "from_checkpoint"  # a new store from a checkpoint, continuing at its iteration
    RESTARTED = "restarted"  # retained memory continued by a process started on it (no agent, or a cold start)
    PROMOTED = "promoted"  # retained memory continued under the agent: a shadow, or a cold start it promoted

    @property
    def continues(self) -> bool:
        """Retained memory is the truth: nothing is created, the views take its values."""
        return self in (RunMode.RESTARTED, RunMode.PROMOTED)


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where this rank sits: its store's name and the node-local group tier 2 spans."""

    rank: int
    node: int = 0
    local_rank: int = 0
    local_world_size: int = 1


class TrainerEngine:
    """One per protected training process (module doc)."""

    def __init__(self, link: RuntimeLink | None = None) -> None:
        self.link = link
        self.bound: RetainedOptimizer | None = None
        self.sharded: RetainedFSDP2 | None = None  # FSDP2: the local shards' binding (``bound`` is its optimizer)
        self.mode = RunMode.UNBOUND

    # -- who --------------------------------------------------------------------------------
    def continues(self, requested: bool = False) -> bool:
        """Whether this process continues from retained memory: asked for (``LETO_RESUME=retained``,
        ``fit(ckpt_path="leto://retained")``), or a shadow or cold restart under the agent."""
        return requested or (self.link is not None and self.link.resumes)

    @property
    def iteration(self) -> int:
        """The next iteration the retained state will update (0 before binding)."""
        return self.bound.iteration if self.bound is not None else 0

    def prepare_barrier(self, world_size: int) -> Callable[[], None] | None:
        """No chunk of an iteration commits before every rank prepared it (the agreement every
        step and the tier-2 set-up use): the session's flag all-reduce under the agent, else the
        process group's barrier, None for one rank."""
        if self.link is not None:
            return self.link.barrier
        if world_size <= 1:
            return None
        return lambda: torch.distributed.barrier()

    # -- the store's set-up: one routine ----------------------------------------------------------
    def create(self, spec: StoreSpec, bind: Callable[[RetainedStore], Binding], *,
               barrier: Callable[[], None] | None, attach_with: str, complete: bool = True) -> Binding:
        """A new store for ``spec``, bound by ``bind`` (``bind(adopt=False)`` of its binding:
        replicated, ZeRO-1 or whole-state), then completed and announced to shadows, unless
        ``complete=False`` (call ``complete()`` once the bound values are final)."""
        self._binding_started()
        bound = set_up_store(spec, bind, barrier=barrier, settings=ProcessSettings.from_env(),
                             attach_with=attach_with, complete=complete)
        self._bound(bound, None)
        if complete:
            self._store_ready()
        return bound

    def complete(self, barrier: Callable[[], None] | None, reencode: bool = False) -> None:
        """The deferred end of ``create(complete=False)``: tier 1 encoded again if something
        wrote the bound values since (``reencode``: DDP's broadcast of rank 0's parameters),
        tier 2, the completion mark; then shadows may attach."""
        ro = self._require_bound()
        if reencode:
            encode_all(ro.store, ro.txn.codes)
        complete_new_store(ro.store, barrier)
        self._store_ready()

    def attach(self, job_id: str, rank: int, bind: Callable[[RetainedStore], Binding]) -> Binding:
        """This rank's existing store, its views bound by ``bind`` without writing anything
        (``bind(adopt=True, resume=False)``: the active trainer may still be training it);
        ``resume()`` takes its values. Under the agent, waits until the store exists."""
        self._binding_started()
        if self.link is not None:
            self.link.wait_for_store()  # a shadow starts beside the active trainer that creates it
        store = RetainedStore.attach(job_id, rank)
        try:
            bound = bind(store)
        except BaseException:
            store.close()
            raise
        self._bound(bound, None, continuing=True)
        return bound

    def bind_replicated(self, optimizer: torch.optim.Optimizer, config: RetainedConfig, *, job_id: str,
                        place: RankPlace, barrier: Callable[[], None] | None, continuing: bool,
                        payload_fn: Callable[[], object] | None = None, names: dict | None = None,
                        rollback_window: bool = False, iteration: int = 0, payload: object = None,
                        attach_with: str = "LETO_RESUME=retained") -> RetainedOptimizer:
        """Every parameter and its optimizer state (DDP, one process; the whole-state undo copy
        with ``rollback_window``): a new store -- starting at ``iteration`` with ``payload``, a
        checkpoint's -- or, continuing, the existing store's views only (``resume()`` takes them)."""

        def bind(store: RetainedStore) -> RetainedOptimizer:
            ro = RetainedOptimizer(optimizer, store, barrier, payload_fn, rollback_window=rollback_window,
                                   settings=ProcessSettings.from_env())
            ro.bind(adopt=continuing, resume=False, iteration=iteration, payload=payload)
            return ro

        if continuing:
            return self.attach(job_id, place.rank, bind)
        config = config_for(config, optimizer)
        config.check_devices(place.local_world_size)
        layout = layout_for(optimizer, config, names, whole_state=rollback_window)
        spec = StoreSpec(job_id, place.rank, place.node, place.local_rank, place.local_world_size, layout, config,
                         replica_shards=1)  # DDP: every rank holds the same state
        return self.create(spec, bind, barrier=barrier, attach_with=attach_with)

    def bind_fsdp2(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RetainedConfig, *,
                   job_id: str, place: RankPlace, barrier: Callable[[], None] | None,
                   payload_fn: Callable[[], object] | None, continuing: bool, checkpoint: str | None = None,
                   iteration: int = 0, payload: object = None) -> RetainedFSDP2:
        """FSDP2's local shards (``updater.fsdp2``): a new store -- loaded from the distributed
        checkpoint ``checkpoint`` (continuing at ``iteration`` with ``payload``) before shadows
        are told -- or, continuing, the existing store's views only (``resume()`` takes them)."""
        settings = ProcessSettings.from_env()
        self._binding_started()
        if continuing:
            if self.link is not None:
                self.link.wait_for_store()
            bound = attach_fsdp2(model, optimizer, job_id=job_id, rank=place.rank, barrier=barrier,
                                 payload_fn=payload_fn, resume=False, settings=settings)
        else:
            if checkpoint is None and (iteration or payload is not None):
                raise UsageError(f"an FSDP2 model restarting at iteration {iteration} needs its distributed "
                                 "checkpoint: pass checkpoint=<the directory RetainedFSDP2.save_checkpoint wrote>")
            bound = create_fsdp2(model, optimizer, config, job_id=job_id, rank=place.rank, node=place.node,
                                 local_rank=place.local_rank, n_local=place.local_world_size, barrier=barrier,
                                 payload_fn=payload_fn, settings=settings)
            if checkpoint is not None:  # before shadows are told: none attaches to a store being restored
                bound.load_checkpoint(checkpoint, iteration=iteration, payload=payload)
        self.sharded = bound
        self._bound(bound.ro, bound, continuing=continuing)
        if not continuing:
            self._store_ready()
        return bound

    def adopt(self, bound: RetainedOptimizer, continuing: bool) -> None:
        """A binding made by an updater entry point that set up (or attached) the store itself
        (``create_zero1`` / ``attach_zero1``): the engine owns it from here."""
        self._bound(bound, None, continuing=continuing)
        if not continuing:
            self._store_ready()

    def resume(self) -> Any:
        """Continue from retained memory: under the agent wait for promotion (a level-3 shadow
        waits here fully built; afterwards the resume clock runs), then the views take the
        committed values (repaired and rolled forward by the agent). Returns the resume payload."""
        if self.link is not None:
            self.link.wait_for_promotion()
        target: RetainedFSDP2 | RetainedOptimizer = self.sharded or self._require_bound()
        return target.resume()

    def _bound(self, ro: RetainedOptimizer, sharded: RetainedFSDP2 | None, continuing: bool = False) -> None:
        self.bound, self.sharded = ro, sharded
        if continuing:
            self.mode = RunMode.PROMOTED if self.link is not None else RunMode.RESTARTED
        else:
            self.mode = RunMode.FROM_CHECKPOINT if ro.iteration > 0 else RunMode.FRESH

    def _binding_started(self) -> None:
        if self.link is not None:
            self.link.binding_started()

    def _store_ready(self) -> None:
        if self.link is not None:
            self.link.store_ready()  # shadows may attach now

    def _require_bound(self) -> RetainedOptimizer:
        if self.bound is None:
            raise UsageError("no retained state is bound in this process (bind before stepping or resuming)")
        return self.bound

    # -- the step -------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None, run: Callable[[Callable[[], Any] | None], Any]) -> Any:
        """One protected optimizer step: ``run(closure)`` runs the closure, then the chunk
        transactions (the binding's step); the agent hears "update" once the closure ran
        (before ``run`` without one) and "done" after the commit."""
        ro = self._require_bound()
        link = self.link
        if link is not None and closure is not None:
            inner = closure

            def closure() -> Any:  # forward and backward, then the agent hears "update"
                out = inner()
                link.update_start(ro.iteration)
                return out
        elif link is not None:  # no closure, or 16-mixed: the plugin ran it before the scaler's step
            link.update_start(ro.iteration)
        loss = run(closure)
        mark_optimizer_stepped(ro.optimizer)  # what the LR scheduler's step wrapper sets
        if link is not None:
            link.step_done(ro.iteration - 1)
        return loss

    # -- the trainer's side of the protocol (nothing without an agent) ----------------------------
    def batch_start(self) -> None:
        """A training batch begins: a heartbeat under the agent; the ``compute.begin`` point."""
        if self.bound is None:
            return
        if self.link is not None:
            self.link.batch_start(self.bound.iteration)  # the heartbeat, then the point
        else:
            point("compute.begin", iteration=self.bound.iteration)

    def alive(self, phase: TrainerPhase) -> None:
        """Between steps (validation, epoch end, checkpoints): a heartbeat at most every interval."""
        if self.link is not None and self.bound is not None:
            self.link.alive(self.bound.iteration - 1, phase)

    def resumed(self) -> None:
        """The loop, RNG and data position are restored: the agent's recovery clock stops here."""
        if self.link is not None and self.link.resume_pending and self.bound is not None:
            self.link.resumed(self.bound.iteration)

    def report_exception(self, exception: BaseException) -> None:
        if self.link is not None:
            self.link.report_exception(exception)

    def finished(self) -> None:
        """Training is complete: a crash while the interpreter exits is then no failure."""
        if self.link is not None:
            self.link.finished()

    # -- the end ----------------------------------------------------------------------------------
    def release(self, unlink: bool = False) -> None:
        """Drop this process's mappings (the parameters' hooks first: they hold the store);
        ``unlink=True`` also frees the job's retained memory (only when no shadow or agent will
        need it any more)."""
        ro, self.bound, self.sharded, self.mode = self.bound, None, None, RunMode.UNBOUND
        if ro is None:
            return
        ro.drop_hooks()
        if unlink:
            ro.store.unlink()
        ro.store.close()
