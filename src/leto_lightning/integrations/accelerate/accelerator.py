"""``LetoAccelerator``: ``accelerate.Accelerator`` whose optimizer state lives in retained memory.

What it changes in ``Accelerator`` (each measured against Accelerate 1.15 and 1.16; docs/accelerate.md):

- construction -- refuses what it cannot protect (``checks.py``); under ``accelerate launch``
  or torchrun each worker ``exec``s into its rank's Leto agent (``runtime/per_rank.py``); under
  ``leto launch`` it connects to the agent and builds the process group in the session's
  namespace before Accelerate looks for one; without CUDA and with several ranks it asks for
  ``cpu=True`` (gloo) instead of letting every rank train alone;
- ``prepare_optimizer`` -- a ``LetoAcceleratedOptimizer`` (``optimizer.py``): Accelerate's
  step, scaler and accumulation semantics, the innermost step a retained transaction;
- ``prepare_data_loader`` -- the prepared loader gets its position (``loader.py``); a
  dispatching one is refused only when a step trains from it;
- ``prepare`` -- once the optimizer's model is prepared (device placement, DDP wrap), binds
  parameters, gradients and optimizer state to retained memory (``binding.py``); with
  Accelerate's FSDP2 plugin (enabled on CPU, ``fsdp2.py``) the local shards, through the core
  FSDP2 binding; an optimizer whose parameters are in no prepared model binds what it holds at
  its first step; its state shows as torch's does (``shown_state.py``);
- ``leto_resume()`` -- after a recovery, puts back what ``save_state`` would plus the data
  position (``payload.py``) and returns where the loop continues;
- ``save_state``/``load_state`` -- Accelerate's checkpoint plus the Leto payload; loading after
  ``prepare()``, at any point, re-initialises the retained store from it (``checkpoint.py``);
  after the agent's checkpoint fallback, the newest checkpoint of the job is loaded
  (``fallback.py``);
- ``init_trackers`` -- one wandb group per job; the main process logs the recovery metrics
  (``recovery_log.py``);
- ``end_training`` -- also tells the agent the job finished (a crash during interpreter exit is
  then no failure) and, without an agent, frees the retained memory.

Without an agent the retained memory is also freed when the accelerator is deleted (nothing it
prepared holds it strongly: no reference cycle) and when the process exits -- including a child
of ``multiprocessing`` (``debug_launcher``, ``notebook_launcher``), which skips ``atexit``.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
from accelerate.utils import InitProcessGroupKwargs
from typing_extensions import override

from ...env import NODE_RANK, under_launcher
from ...errors import ConfigurationError, UsageError
from ...faults.points import point
from ...runtime import per_rank
from ...runtime.engine import RankPlace, TrainerEngine, agreed_new_job_id
from ...runtime.link import RuntimeLink
from ...updater.fsdp2 import RetainedFSDP2
from ...updater.retained_optimizer import RetainedOptimizer
from . import checkpoint, fallback, fsdp2, zero1
from .binding import param_names
from .checks import WHO, check_distributed, refuse_unsupported, the_optimizer
from .config import LetoConfig
from .internals import is_accelerate_prepared, prepared_models, prepared_optimizers, register_optimizer
from .loader import is_positioned, is_resumable, positioned
from .optimizer import LetoAcceleratedOptimizer
from .payload import BOUNDARY, PREPARE, ResumePoint, capture, restore
from .recovery_log import RecoveryLog, tracker_kwargs
from .shown_state import ShownState, shows_torch_state
from .state import RunState
from .versions import check_accelerate

log = logging.getLogger(__name__)


class LetoAccelerator(Accelerator):
    """``Accelerator`` with retained optimizer state and in-place recovery (module doc).

    Every ``Accelerator`` argument works as before; Leto's options come in ``leto=LetoConfig(...)``
    (overridable by ``LETO_<FIELD>`` environment variables).
    """

    def __init__(self, *args: Any, leto: LetoConfig | None = None, **kwargs: Any) -> None:
        check_accelerate()
        if leto is not None and not isinstance(leto, LetoConfig):
            raise ConfigurationError(f"leto={leto!r}: pass leto=LetoConfig(...) (from leto_lightning.accelerate)")
        config = (leto if leto is not None else LetoConfig()).with_environment()
        refuse_unsupported(kwargs)
        fsdp_plugin = fsdp2.requested_plugin(kwargs)
        if fsdp_plugin is not None:
            kwargs["fsdp_plugin"] = fsdp_plugin  # one plugin object (also when it came from the environment)
        if fsdp_plugin is not None and config.rollback_window:
            raise ConfigurationError(f"{WHO}: LetoConfig(rollback_window=True) with FSDP2: the exact mode's "
                                     "whole-state undo copy is not built for local shards yet -- leave "
                                     "rollback_window=False")
        self.leto_config = config
        self.leto_options = config.runtime_options()
        self.retained_config = config.retained_config()
        # the trainer-side engine: binding, step protocol, the link to the agent under a Leto launcher
        self.engine = TrainerEngine(RuntimeLink(config.heartbeat_interval) if under_launcher() else None)
        self.leto_optimizer: LetoAcceleratedOptimizer | None = None
        self._leto_shown: ShownState | None = None  # optimizer state shown as torch's (shown_state.py)
        self._leto_release: multiprocessing.util.Finalize | None = None  # frees the store without an agent
        self.leto_loaders: list = []
        self.leto_recoveries = 0
        self.leto_recovery_log = RecoveryLog()  # recovery metrics through the trackers (recovery_log.py)
        self.leto_state = RunState()  # the start mode and the step phase (state.py)
        self._leto_payload: Any = None
        self._leto_point: ResumePoint | None = None
        self._last_loader: Any = None
        self._train_loader: Any = None
        self._leto_from_checkpoint = False  # the payload to resume from came from load_state, not a recovery
        self._leto_fallback: tuple[int, str] | None = None  # (iteration, dir) to load after the fallback
        self._leto_fallback_known = False  # looked up already (fallback.py; a collective, once)
        if self.runtime is None and os.environ.get("TORCHELASTIC_RUN_ID"):
            launch = per_rank.from_torchrun()
            per_rank.check_numbering(launch, WHO)
            per_rank.become_rank_agent(launch, per_rank.plain_script(), WHO, self.leto_options.shadow_level,
                                       self.leto_options.heartbeat_timeout)  # execs, or raises saying what to do
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not torch.cuda.is_available() and not kwargs.get("cpu"):
            kwargs["cpu"] = True  # else each rank would silently train alone (DistributedType.NO)
        if self.runtime is not None:
            self._connect(world, kwargs.get("kwargs_handlers") or ())
        super().__init__(*args, **kwargs)
        if fsdp_plugin is not None:
            fsdp2.fsdp2_on_cpu(self, fsdp_plugin)  # what Accelerate does on GPUs (fsdp2.py)
        check_distributed(self)

    @property
    def runtime(self) -> RuntimeLink | None:
        """The link to the agent under a Leto launcher (the engine's), else None."""
        return self.engine.link

    @property
    def retained(self) -> RetainedOptimizer | None:
        """This rank's retained binding (the engine's), None before ``prepare()`` binds it."""
        return self.engine.bound

    @property
    def leto_fsdp2(self) -> RetainedFSDP2 | None:
        """FSDP2: the binding of the local shards (``fsdp2.py``; ``retained`` is its optimizer)."""
        return self.engine.sharded

    def _connect(self, world: int, handlers: Any) -> None:
        """Under ``leto launch``: the session first (L1/L2 shadows wait here), then the process
        group in its namespace, with ``InitProcessGroupKwargs``' backend and timeout."""
        assert self.runtime is not None
        self.runtime.connect()
        # One rank too: with LOCAL_RANK set (every launcher sets it) Accelerate would start its own
        # group on MASTER_PORT, which the agent's store holds.
        if torch.distributed.is_initialized() or (world <= 1 and "LOCAL_RANK" not in os.environ):
            return
        init = next((h for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
        backend = (init.backend if init is not None and init.backend else None) or (
            "nccl" if torch.cuda.is_available() else "gloo")
        timeout = init.timeout if init is not None and init.timeout is not None else timedelta(minutes=30)
        self.runtime.init_process_group(backend, timeout.total_seconds())

    # -- prepare ----------------------------------------------------------------------------
    @override
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        result = super().prepare(*args, device_placement=device_placement)
        self._bind_if_ready()
        return result

    @override
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
        if is_accelerate_prepared(optimizer):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if device_placement is None:
            device_placement = self.device_placement
        if zero1.is_zero1(optimizer):
            device_placement = False  # ZeRO's state_dict() needs a collective first; its state is empty (zero1.py)
        prepared = LetoAcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.scaler,
                                            bind_late=_weak(self._bind_late))
        register_optimizer(self, prepared)
        return prepared

    @override
    def prepare_data_loader(self, data_loader: Any, device_placement: Any = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        prepared = super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if isinstance(prepared, (DataLoaderShard, DataLoaderDispatcher)) and not is_positioned(prepared):
            # a dispatcher cannot be put back at a position: refused only if a step trains from it
            positioned(prepared, self, len(self.leto_loaders), resumable=not isinstance(prepared, DataLoaderDispatcher))
            self.leto_loaders.append(prepared)
        return prepared

    def _bind_if_ready(self) -> None:
        """Bind once the optimizer and every model holding its parameters are prepared."""
        if self.retained is not None or not prepared_optimizers(self):
            return
        prepared = the_optimizer(prepared_optimizers(self))
        if self._outside_models(prepared) is None:
            self._bind_now(prepared)
        # else: the model comes in a later prepare() call, or never (bound at the first step)

    def _outside_models(self, prepared: LetoAcceleratedOptimizer) -> str | None:
        """A parameter of the optimizer in no prepared model (described), else None."""
        in_models = {id(p) for m in prepared_models(self) for p in m.parameters()}
        for j, group in enumerate(prepared.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in in_models:
                    return f"param_groups[{j}]['params'][{i}] (shape {tuple(p.shape)})"
        return None

    def _bind_late(self) -> None:
        """The first step (or ``leto_resume()``) of an optimizer whose parameters are in no prepared
        model -- a model built after the optimizer, parameters remapped after ``prepare()``: bind
        the parameters it holds now, keeping the gradients computed so far. A process that may
        continue a job from retained memory must bind at ``prepare()``: refused there."""
        if self.retained is not None:
            return
        prepared = the_optimizer(prepared_optimizers(self))
        stray = self._outside_models(prepared)
        if stray is not None and (self.runtime is not None or self.leto_options.resume_requested()
                                  or self.is_fsdp2 or zero1.is_zero1(prepared.optimizer)):
            raise UsageError(f"{WHO}: the optimizer's {stray} belongs to no prepared model; under a Leto launcher, "
                             "with LETO_RESUME=retained, FSDP2 or ZeRO-1 the parameters bind at prepare() -- pass "
                             "the model the optimizer was built from to accelerator.prepare()")
        params = [p for g in prepared.optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        self._bind_now(prepared)
        ro = self.retained
        assert ro is not None
        with torch.no_grad():
            for i, (p, grad) in enumerate(zip(ro.params, grads)):
                if grad is not None and grad is not p.grad:
                    p.grad.copy_(grad)
                    ro.mark_received(i)

    def _bind_now(self, prepared: LetoAcceleratedOptimizer) -> None:
        job = self.leto_options.resolved_job_id() or agreed_new_job_id(self.num_processes)
        continuing = self.engine.continues(self.leto_options.resume_requested())
        self.leto_state.bound(continuing)
        if self.is_fsdp2:
            (model,) = prepared_models(self)  # Accelerate's FSDP2 prepares exactly one model
            fsdp2.bind(self.engine, model, prepared.optimizer, self.retained_config, job, self._place(), continuing,
                       self._barrier(), _weak(self._payload))
        else:
            self._bind(prepared, job, continuing)
            prepared.optimizer.zero_grad = self.engine.bound.zero_grad  # type: ignore[union-attr]  # in place: gradients stay retained views
        ro = self.engine.bound
        assert ro is not None
        if continuing:
            self._leto_payload = self.engine.resume()  # a level-3 shadow waits here, fully built
        elif self.runtime is not None:
            if fallback.starting_fresh():
                fallback.forget(self.runtime.run_dir, self.process_index)
        else:  # no agent will free it: deleting the accelerator or the process exiting does
            self._leto_release = multiprocessing.util.Finalize(self, _free, args=(self.engine,), exitpriority=0)
        prepared.bind_step(_weak(self._retained_step))
        self.leto_optimizer = prepared
        if shows_torch_state(ro) and self.leto_fsdp2 is None:
            self._leto_shown = ShownState(ro)
            self._leto_shown.refresh()

    def _payload(self) -> dict:
        return capture(self, PREPARE, self._train_loader)

    def _bind(self, prepared: LetoAcceleratedOptimizer, job: str, continuing: bool) -> None:
        """DDP (or one process): the full parameters and their optimizer state (binding.py);
        ZeRO-1: the params this rank owns (zero1.py)."""
        rollback, barrier = self.leto_config.rollback_window, self._barrier()
        names = param_names(prepared_models(self))
        if zero1.is_zero1(prepared.optimizer):
            owned = zero1.bind(prepared.optimizer, self.retained_config, job, self._place(), continuing, barrier,
                               _weak(self._payload), names, under_launcher=self.runtime is not None,
                               rollback_window=rollback)
            self.engine.adopt(owned, continuing)
        else:
            self.engine.bind_replicated(prepared.optimizer, self.retained_config, job_id=job, place=self._place(),
                                        barrier=barrier, continuing=continuing, payload_fn=_weak(self._payload),
                                        names=names, rollback_window=rollback)

    def _place(self) -> RankPlace:
        env = os.environ
        return RankPlace(self.process_index, int(env.get("GROUP_RANK", env.get(NODE_RANK, "0"))),
                         self.local_process_index, int(env.get("LOCAL_WORLD_SIZE", str(self.num_processes))))

    def _barrier(self) -> Callable[[], None] | None:
        """No chunk of an iteration commits before every rank prepared it."""
        return self.engine.prepare_barrier(self.num_processes)

    # -- the step and the batches -------------------------------------------------------------
    def _retained_step(self, closure: Callable | None) -> Any:
        """The torch step's stand-in: prepare (payload), chunk transactions, commit."""
        ro = self.retained
        assert ro is not None
        self._check_resumed()
        if not is_resumable(self._last_loader):
            raise ConfigurationError(
                f"{WHO}: a training step on batches of a dispatching data loader (DataLoaderConfiguration("
                "dispatch_batches=True), the default for an IterableDataset), which cannot be put back at a position "
                "after a recovery -- train from a map-style Dataset or with dispatch_batches=False (evaluating or "
                "loading data with it is fine)")
        self._train_loader = self._last_loader
        loss = self.engine.step(closure, self.leto_fsdp2.step if self.leto_fsdp2 is not None else ro.step)
        if self._leto_shown is not None:
            self._leto_shown.after_step()
        self.leto_state.stepped()
        point("accelerate.after_step", iteration=ro.iteration - 1)
        return loss

    def _leto_before_batch(self, loader: Any) -> None:
        """A prepared loader is about to yield a batch: the step before it is complete (the
        ``boundary`` payload replaces its ``prepare`` payload), heartbeat, fault point."""
        ro = self.retained
        if ro is None:
            return
        if self.leto_state.boundary_due() and loader is self._train_loader:
            self.leto_state.recorded()
            self._record(capture(self, BOUNDARY, loader))
        self._last_loader = loader
        if loader is self._train_loader:
            self.leto_recovery_log.log_new(self, ro.iteration)
        self.engine.batch_start()

    def _record(self, payload: dict) -> None:
        """The resume payload of the last committed iteration, replaced (exact mode: sealed)."""
        ro = self.retained
        assert ro is not None
        ro.record_committed(payload)

    def _check_resumed(self) -> None:
        if self.leto_state.awaiting_resume:
            raise UsageError(f"{WHO}: this process continues a job from retained memory; call "
                             "accelerator.leto_resume() after prepare() and start the loop where it says")

    def _leto_iter_started(self, loader: Any) -> None:
        if self.retained is not None:
            self._check_resumed()

    # -- resume -------------------------------------------------------------------------------
    def leto_resume(self) -> ResumePoint | None:
        """``None`` on a fresh start. After a recovery: the retained state is in place, the
        schedulers, scaler, ``step``, RNG and registered objects are put back, the prepared data
        loaders start at the next batch; returns where the loop continues."""
        if self.retained is None and prepared_optimizers(self):
            self._bind_late()  # its parameters are in no prepared model: bound now (or refused)
        if self.retained is None:
            raise UsageError(f"{WHO}.leto_resume(): call it after accelerator.prepare(model, optimizer, ...)")
        newest = self._fallback_checkpoint()
        if newest is not None and not self._leto_from_checkpoint:
            self.load_state(newest[1])  # the agent's checkpoint fallback: the newest save_state of this job
        if not self.leto_state.resume_due:  # fresh (None), or resumed or trained already (the same point)
            return self._leto_point
        self.leto_state.resumed()
        (self.leto_fsdp2 or self.retained).zero_grad()  # a crashed accumulation's partial gradients are dropped
        payload = self._leto_payload
        self._leto_point = restore(self, payload) if payload is not None else None
        self.leto_recoveries = (payload or {}).get("recoveries", 0) + (0 if self._leto_from_checkpoint else 1)
        self.engine.resumed()
        if self.trackers and self.is_main_process:
            self.log({"leto/recoveries": self.leto_recoveries, "leto/resume_step": self.retained.iteration},
                     step=self.retained.iteration)
        log.info("%s resumed at step %d (%s)", WHO, self.retained.iteration, self._leto_point)
        return self._leto_point

    @override
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        """Accelerate's checkpoint plus this rank's Leto payload (``checkpoint.py``)."""
        if self.retained is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        if self.leto_fsdp2 is not None:  # Accelerate's FSDP2 saver (DCP) reads the retained views itself
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        else:
            with checkpoint.compact_saves(self):
                location = super().save_state(output_dir, safe_serialization, **kwargs)
        checkpoint.save(self, str(location))
        if self.runtime is not None:  # the agent's checkpoint fallback loads the newest (fallback.py)
            fallback.remember(self.runtime.run_dir, self.process_index, self.retained.iteration, str(location))
        return location

    @override
    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> Any:
        """Once bound: a fresh process re-initialises its retained store from the checkpoint and
        ``leto_resume()`` says where to continue; a continuing one loads nothing (``checkpoint.py``)."""
        if self.retained is None:
            return super().load_state(input_dir, **kwargs)
        newest = self._fallback_checkpoint()
        if newest is not None and not self._leto_from_checkpoint:
            log.info("%s: restarted by the agent's checkpoint fallback: loading %s (step %d, the newest checkpoint "
                     "of this job) instead of %s", WHO, newest[1], newest[0], input_dir)
            input_dir = newest[1]
        def load_files(where: str | None) -> Any:
            return super(LetoAccelerator, self).load_state(where, **kwargs)

        if self.leto_fsdp2 is not None:
            return checkpoint.load_fsdp2(self, self.leto_fsdp2, input_dir, load_files)
        return checkpoint.load(self, input_dir, load_files, strict=kwargs.get("strict", True))

    def _fallback_checkpoint(self) -> tuple[int, str] | None:
        """Restarted by the agent's checkpoint fallback: the newest checkpoint every rank saved in
        this job (a collective, looked up once), else None."""
        if not self._leto_fallback_known:
            self._leto_fallback_known = True
            if self.runtime is not None and fallback.restarting_from_checkpoint():
                self._leto_fallback = fallback.newest_common(self.runtime.run_dir, self.process_index,
                                                             self.num_processes)
        return self._leto_fallback

    # -- trackers and the end -----------------------------------------------------------------
    @override
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Accelerate's trackers; under an agent one wandb group per job, and the main process
        logs the recovery metrics (``recovery_log.py``)."""
        if self.runtime is not None:
            init_kwargs = tracker_kwargs(init_kwargs, self.runtime.run_dir)
            if self.is_main_process:
                self.leto_recovery_log.start(self.runtime.run_dir)
        super().init_trackers(project_name, config, init_kwargs)

    @override
    def end_training(self) -> None:
        ro = self.retained
        if ro is not None and ro.rollback_window and self.leto_state.boundary_due():
            self.leto_state.recorded()
            self._record(capture(self, BOUNDARY, self._train_loader))  # the last step is complete
        if ro is not None:
            self.leto_recovery_log.finish(self, ro.iteration)
        super().end_training()
        if self.runtime is not None:
            self.engine.finished()  # a crash during interpreter exit is no failure
        elif ro is not None:
            if self._leto_release is not None:
                self._leto_release()  # runs _free once, and never again at exit
            else:  # continued from retained memory without an agent (LETO_RESUME=retained): freed here only
                _free(self.engine)
            self.leto_state.unbound()


def _free(engine: TrainerEngine) -> None:
    """Free a store nothing else will attach to (no agent): unlink, and unmap once nothing views
    it (the model's parameters stay valid memory while they live: ``SharedSegment.close``); the
    engine, not the accelerator, is what the finalizer holds (no reference back to it).

    Run by a ``multiprocessing.util.Finalize`` -- not ``atexit``/``weakref.finalize``: a child of
    ``multiprocessing`` (Accelerate's ``debug_launcher`` and ``notebook_launcher`` fork through
    it) ends with ``os._exit`` after running these finalizers, never ``atexit``; the main process
    runs them at exit too. A finalizer only runs in the process that registered it (a forked
    child neither runs nor inherits its parent's)."""
    engine.release(unlink=True)


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound to the accelerator), held weakly: what the accelerator gives the prepared
    optimizer, loaders and store must not keep it alive (``del accelerator`` frees it at once)."""
    return _WeakMethod(method)


def _gone() -> None:
    return None


class _WeakMethod:
    """A method of the accelerator, held weakly; picklable as Accelerate's prepared objects are
    (an unpickled copy belongs to no accelerator)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._ref: Callable[[], Callable[..., Any] | None] = weakref.WeakMethod(method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._ref()
        if bound is None:
            raise UsageError(f"{WHO}: the accelerator that prepared this optimizer was deleted -- keep it while "
                             "training")
        return bound(*args, **kwargs)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._ref = _gone
