"""Plain PyTorch's protected training loop: ``Session.protect`` and its handle.

The handle is a thin loop API over the trainer-side engine (``engine.py``), which the
Lightning and Accelerate integrations hold too: binding, the step protocol and the agent's
messages are the engine's; what is here is only what a hand-written loop calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..retained.config import RetainedConfig
from ..retained.layout import GRAD
from ..updater.fsdp2 import RetainedFSDP2, is_fsdp2
from .engine import RankPlace, TrainerEngine
from .link import RuntimeLink
from .session import Session
from .session import init as connect_session


class TrainingSession(Session):
    """``leto_lightning.runtime.init()``'s session: the agent's connection (``Session``) and
    ``protect``, which binds the training loop through a trainer-side engine."""

    def protect(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                config: RetainedConfig | None = None, start_iteration: int = 0,
                payload: object = None, checkpoint: str | None = None) -> ProtectedTraining:
        """Bind ``model``/``optimizer`` to retained memory; returns where to start.

        A fresh job (or a restart from a checkpoint: pass the checkpoint's next iteration and
        resume payload) creates the retained store; shadows and cold restarts attach to it.
        A model sharded with FSDP2 (``fully_shard``) keeps its local shards there; FSDP2's
        reduce-scatter then averages the gradients. Its checkpoint is a distributed checkpoint
        directory (``checkpoint``), loaded into the retained views."""
        return protect(self, model, optimizer, config, start_iteration, payload, checkpoint)


def init() -> TrainingSession:
    """Connect to the agent of ``leto launch``. Shadows at level 1 or 2 wait here."""
    return connect_session(TrainingSession)


def protect(session: Session, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            config: RetainedConfig | None, start_iteration: int, payload: object,
            checkpoint: str | None) -> ProtectedTraining:
    """``Session.protect`` (its doc): bind through a new engine, resume if continuing."""
    sharded = is_fsdp2(model)
    if checkpoint is not None and not sharded:
        raise UsageError(f"protect(checkpoint={checkpoint!r}) is for FSDP2 models; load a DDP model's and "
                         "optimizer's state dicts before protect and pass start_iteration and payload")
    if session.is_shadow and session.env.level < 3:
        session.wait_for_promotion()
    link = RuntimeLink(session=session)
    link.binding_started()  # protect() begins here: the agent's `start` ends (docs/events.md)
    engine = TrainerEngine(link)
    e, config = session.env, config or RetainedConfig()
    continuing = not session.creates_store
    place = RankPlace(e.rank, e.node, e.local_rank, e.local_world_size)
    if sharded:
        engine.bind_fsdp2(model, optimizer, config, job_id=e.job_id, place=place, barrier=session.barrier,
                          payload_fn=None, continuing=continuing, checkpoint=checkpoint,
                          iteration=start_iteration, payload=payload)
    else:
        engine.bind_replicated(optimizer, config, job_id=e.job_id, place=place, barrier=session.barrier,
                               continuing=continuing, iteration=start_iteration, payload=payload,
                               attach_with="session.protect in a shadow or a restart")
    if continuing:
        payload = engine.resume()  # L3 shadows wait here, fully built
        engine.resumed()
    return ProtectedTraining(session, model, engine, payload)


class ProtectedTraining:
    """The training loop's handle: iteration bookkeeping, gradient all-reduce, the step."""

    def __init__(self, session: Session, model: torch.nn.Module, engine: TrainerEngine, payload: object) -> None:
        ro = engine.bound
        assert ro is not None  # protect() bound it
        self.session = session
        self.model = model
        self.engine = engine
        self.optimizer = ro
        self.sharded: RetainedFSDP2 | None = engine.sharded  # FSDP2: the local shards' binding (ro is its optimizer)
        self.start_iteration = ro.iteration
        self.payload = payload
        self._next_payload: object = None
        ro.barrier = session.barrier
        ro.payload_fn = lambda: self._next_payload

    def begin(self, iteration: int) -> None:
        if iteration != self.optimizer.iteration:
            raise UsageError(f"iteration {iteration} begun, but retained state is at {self.optimizer.iteration}")
        self.engine.batch_start()
        (self.sharded or self.optimizer).zero_grad()  # FSDP2: the DTensor grads point at their views again

    def all_reduce_grads(self) -> None:
        """Average the retained gradients across ranks: one all-reduce per flat buffer (FSDP2:
        nothing to do, its reduce-scatter averaged each rank's shard of them)."""
        if self.sharded is not None or not dist.is_initialized() or self.session.world_size == 1:
            return
        store = self.optimizer.store
        for seg in store.layout.segments:
            grads = store.region_view(seg.index, GRAD)
            dist.all_reduce(grads)
            grads.div_(self.session.world_size)

    def step(self, payload: object = None) -> None:
        self._next_payload = payload
        sharded = self.sharded
        if sharded is not None:  # through the optimizer: an LR scheduler built on it sees the step
            self.engine.step(None, lambda _closure: sharded.optimizer.step())
        else:
            self.engine.step(None, self.optimizer.step)

    def finish(self) -> None:
        if dist.is_initialized():
            self.session.barrier()
            dist.destroy_process_group()
        self.engine.finished()

