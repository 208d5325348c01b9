"""``LetoModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2) whose local
shards live in retained memory. ``Trainer(strategy="leto_fsdp2")``.

The model is sharded as under ``ModelParallelStrategy``: ``fully_shard`` in the module's
``configure_model`` over ``self.device_mesh["data_parallel"]`` (every rank, by default). What
changes (each measured against Lightning 2.6.6; see docs/lightning.md, "Sharded models"):

- ``setup_optimizers`` -- once the optimizer exists (after ``configure_model`` sharded the
  model), this rank's local shards, their gradients and the optimizer state are bound to its
  retained store by the core binding (``updater.fsdp2``: ``create_fsdp2`` / ``attach_fsdp2``,
  under ``leto launch`` the session's ``bind_fsdp2``). A shadow binds views only and waits
  for its promotion there.
- ``optimizer_step`` -- the precision plugin steps a proxy (``proxy.py``) whose ``step`` runs
  the closure (forward, backward, clipping of the DTensor gradients: the global norm) and then
  the chunk transactions over the local shards.
- ``load_checkpoint`` -- ``"leto://retained"`` is the in-memory checkpoint of the resume payload;
  a checkpoint file (``ModelParallelStrategy``'s distributed checkpoint, which ``ModelCheckpoint``
  saves from the retained views) loads straight into a new store's views inside
  ``RetainedFSDP2.restoring`` (the store is initialised once, at the file's step).
- everything else a Leto fit does (resume payload, loop-state callback, loaders, the session,
  the logs) is ``fit_hooks.py``, shared with ``LetoStrategy``.

Name: ``"leto_fsdp2"`` -- not ``"leto_fsdp"``, which reads as Lightning's ``"fsdp"`` (FSDP1)
with Leto: that combination is refused, this strategy is FSDP2 only.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from ...env import ProcessSettings
from ...errors import ConfigurationError, UsageError
from ...retained.config import RetainedConfig
from ...runtime.link import RuntimeLink
from ...runtime.storage import replace_dir
from ...updater.fsdp2 import RetainedFSDP2, attach_fsdp2, create_fsdp2
from ...updater.retained_optimizer import RetainedOptimizer
from .callback import LetoLoopStateCallback
from .checks import check_sharded_model, check_sharded_trainer, the_optimizer
from .data import ResumableDataLoader
from .fit_hooks import (
    agreed_new_job_id,
    begin_fit,
    check_retained_resume,
    checkpoint_saved,
    fault_point,
    file_payload,
    init_session_group,
    install_loop_state,
    leto_settings,
    payload_checkpoint,
    payload_fn,
    prepare_barrier,
    prepare_logs,
    record_payload,
    release,
    resume_can_follow,
    retained_step,
    train_batch_start,
    train_end,
    train_start,
    wrap_train_loader,
)
from .fit_state import FitMode, FitState
from .frozen import FrozenPayload
from .internals import (
    attached_trainer,
    saves_distributed_checkpoint,
    set_launcher,
    set_process_group_backend,
    shard_every_rank,
)
from .launcher import LetoLauncher, check_launch
from .logs import LogKeeper
from .options import RETAINED_CKPT
from .proxy import proxy_for, real_optimizer
from .resume import apply_param_groups
from .versions import check_lightning

FSDP2_STRATEGY_NAME = "leto_fsdp2"


class LetoModelParallelStrategy(ModelParallelStrategy):
    """FSDP2 with retained local shards and crash-consistent updates (module doc).

    Takes ``LetoStrategy``'s options (``retained=RetainedConfig(...)`` or its fields one by
    one, ``job_id``, ``resume``, ``shadow_level``, heartbeats, ``keep_retained``) and
    ``ModelParallelStrategy``'s; ``data_parallel_size`` defaults to every rank and
    ``tensor_parallel_size`` must stay 1 (the retained binding supports ``Shard(0)`` on a 1-D
    mesh).
    """

    strategy_name = FSDP2_STRATEGY_NAME

    def __init__(self, *, retained: RetainedConfig | None = None, job_id: str | None = None,
                 resume: str | None = None, shadow_level: int | str = 3, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 60.0, keep_retained: bool = False, **kwargs: Any) -> None:
        check_lightning()
        settings = leto_settings(kwargs, retained, job_id, resume, shadow_level, heartbeat_interval,
                                 heartbeat_timeout)
        self.retained_config, self.leto_options = settings.retained, settings.options
        cluster_environment = kwargs.pop("cluster_environment", None)
        if kwargs.get("tensor_parallel_size", 1) not in (1, "auto"):
            raise ConfigurationError(f"tensor_parallel_size={kwargs['tensor_parallel_size']!r}: {type(self).__name__} "
                                     "retains FSDP2 shards on a 1-D data-parallel mesh; leave tensor_parallel_size=1")
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)
        self.cluster_environment = cluster_environment
        self.runtime: RuntimeLink | None = settings.runtime
        self.logs = LogKeeper()
        self.loop_state = LetoLoopStateCallback()
        self.loop_state.attach(self)
        self.retained: RetainedOptimizer | None = None
        self.sharded: RetainedFSDP2 | None = None  # the binding of the local shards (retained is its optimizer)
        self.keep_retained = keep_retained
        self.job_id: str | None = None
        self.fit_state = FitState()
        self.env_resume_used = False
        self.resume_payload: Any = None
        self.resumed_from: dict | None = None
        self.train_loaders: weakref.WeakSet[ResumableDataLoader] = weakref.WeakSet()
        self._proxy: torch.optim.Optimizer | None = None

    @override
    def __getstate__(self) -> dict[str, Any]:
        """A pickled copy is detached, as ``LetoStrategy``'s: no retained memory travels."""
        return dict(self.__dict__, retained=None, sharded=None, _proxy=None, runtime=None, train_loaders=None,
                    fit_state=self.fit_state.detached())

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.train_loaders = weakref.WeakSet()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entry = dict.get(strategy_registry, FSDP2_STRATEGY_NAME)  # the registry's own get() instantiates
        if entry is None or getattr(entry["strategy"], "leto_factory", False):  # or the package's import-time one
            strategy_registry.register(FSDP2_STRATEGY_NAME, cls, override=True,
                                       description="Leto: FSDP2 (fully_shard) with retained local shards")

    @property
    def module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise UsageError(f"{type(self).__name__}: no LightningModule is connected (this runs inside trainer.fit())")
        return module

    @property
    def retained_active(self) -> bool:
        return self.retained is not None

    @property
    def committed_any(self) -> bool:
        return self.retained is not None and self.retained.iteration > 0

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """A checkpoint built from a Leto payload carries the hyper-parameters (lr, ...) to apply
        (``load_optimizer_state_dict``); a plain distributed checkpoint loaded them itself."""
        return self.fit_state.mode.from_retained_memory or self.resume_payload is not None

    @override
    def _configure_launcher(self) -> None:
        check_launch(self)  # Leto never spawns ranks; say how to start them
        set_launcher(self, LetoLauncher(self))

    # -- environment -------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        if self.runtime is not None:
            self.runtime.connect()  # shadows at level 1/2 wait here until promoted
        shard_every_rank(self)
        super().setup_environment()
        prepare_logs(self)

    @override
    def _setup_distributed(self) -> None:
        if self.runtime is None:
            super()._setup_distributed()
            return
        set_process_group_backend(self)
        init_session_group(self, self.runtime)

    # -- setup -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_sharded_trainer(self, trainer)
            install_loop_state(self, trainer)
        assert self.model is not None
        check_sharded_model(self.model, type(self).__name__)
        super().setup(trainer)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._bind_retained(trainer)

    def _bind_retained(self, trainer: pl.Trainer) -> None:
        """This rank's local shards into retained memory; a shadow waits for its promotion here."""
        optimizer = the_optimizer(self, trainer)
        if not self.module.automatic_optimization:
            raise ConfigurationError(f"{type(self).__name__}: manual optimization is not supported with retained "
                                     "FSDP2 shards yet; use automatic optimization or strategy='leto' (DDP)")
        if self.fit_state.mode is FitMode.NONE:  # a fit the launcher did not see
            self.fit_state.begin(FitMode.FRESH)
        self.job_id = self.leto_options.resolved_job_id() or self.job_id or agreed_new_job_id(self)
        shown = [list(group["params"]) for group in optimizer.param_groups]  # the DTensor params, for clipping
        bound = self._bind(optimizer, payload_fn(self, trainer))
        self.sharded, self.retained = bound, bound.ro
        mode = self.fit_state.mode
        if mode is FitMode.SHADOW:
            assert self.runtime is not None  # SHADOW: under leto launch
            self.runtime.wait_for_promotion()  # a level-3 shadow waits here, fully built
        if mode.from_retained_memory:
            self.resume_payload = bound.resume()
        self.logs.continue_from(trainer, self.resume_payload)
        self._proxy = proxy_for(optimizer, self._retained_step, shown)

    def _bind(self, optimizer: torch.optim.Optimizer, payload: Callable[[], object]) -> RetainedFSDP2:
        assert self.model is not None and self.job_id is not None
        barrier = prepare_barrier(self)
        if self.runtime is not None:  # the session creates, or (a shadow, a cold restart) attaches views only
            return self.runtime.connect().bind_fsdp2(self.model, optimizer, self.retained_config, barrier=barrier,
                                                     payload_fn=payload)
        if self.fit_state.mode.from_retained_memory:
            return attach_fsdp2(self.model, optimizer, job_id=self.job_id, rank=self.global_rank, barrier=barrier,
                                payload_fn=payload, resume=False, settings=ProcessSettings.from_env())
        self.retained_config.check_devices(self.num_processes)
        return create_fsdp2(self.model, optimizer, self.retained_config, job_id=self.job_id, rank=self.global_rank,
                            node=self.node_rank, local_rank=self.local_rank, n_local=self.num_processes,
                            barrier=barrier, payload_fn=payload, settings=ProcessSettings.from_env())

    # -- the step ----------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        ro = self.retained
        if ro is None or real_optimizer(optimizer) is not ro.optimizer:
            raise UsageError(f"{type(self).__name__}: this optimizer is not bound to retained memory (created "
                             "outside configure_optimizers?); it would train without protection")
        assert self._proxy is not None
        return super().optimizer_step(self._proxy, closure, model, **kwargs)

    def _retained_step(self, closure: Callable | None) -> Any:
        assert self.sharded is not None
        return retained_step(self, closure, self.sharded.step)

    def record_payload(self, payload: Any) -> None:
        record_payload(self, payload)

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        resumed, self.resumed_from = self.resumed_from or {}, None
        train_start(self, resumed)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        train_batch_start(self, batch_idx)

    @override
    def on_train_end(self) -> None:
        train_end(self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.runtime is not None:
            self.runtime.report_exception(exception)
        super().on_exception(exception)

    def fault_point(self, name: str, phase: str) -> None:
        fault_point(self, name, phase)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A distributed checkpoint is written whole or not at all: every rank writes its shards
        into a new directory beside ``filepath``, and only once all have (a barrier) does rank 0
        put it in place of the old one -- ``ModelParallelStrategy`` writes into an existing
        directory (``last.ckpt`` every time), so a rank killed mid-save left new shards of some
        ranks beside old shards of others, which a restart loaded as one checkpoint."""
        path = Path(self.broadcast(str(filepath)))
        if not saves_distributed_checkpoint(self):
            super().save_checkpoint(checkpoint, path, storage_options)
        else:
            staged = path.with_name(f".{path.name}.saving")
            if self.is_global_zero and staged.exists():
                shutil.rmtree(staged)  # a save a crash interrupted: never complete, never used
            self.barrier("leto-ckpt-staged")
            super().save_checkpoint(checkpoint, staged, storage_options)
            self.barrier("leto-ckpt-written")  # every rank's shards (and rank 0's metadata) are on disk
            if self.is_global_zero:
                replace_dir(staged, path)
            self.barrier("leto-ckpt-placed")
        checkpoint_saved(self, checkpoint, self.is_global_zero)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return wrap_train_loader(self, super().process_dataloader(dataloader))

    # -- resume --------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if str(checkpoint_path) == RETAINED_CKPT:
            check_retained_resume(self)
            return payload_checkpoint(self)
        if self.sharded is None or str(checkpoint_path) != str(self.fit_state.ckpt_file):
            return super().load_checkpoint(checkpoint_path, weights_only)
        # fit(ckpt_path=<file>): the distributed checkpoint loads straight into the new store's
        # views, which is then initialised once at the file's step with its Leto payload
        with self.sharded.restoring() as restore:
            ckpt = super().load_checkpoint(checkpoint_path, weights_only)
            self.resume_payload = file_payload(ckpt)
            restore.iteration = int(ckpt.get("global_step", 0))
            restore.payload = None if self.resume_payload is None else FrozenPayload(self.resume_payload)
        if self.resume_payload is None:  # a checkpoint without a Leto payload: Lightning's own restore
            return ckpt
        return payload_checkpoint(self)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The shards are retained already; a retained checkpoint carries the module's buffers."""
        if "leto" not in checkpoint:
            return
        state = checkpoint["state_dict"]
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                if name in state:
                    buffer.copy_(state[name])

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if "leto" in checkpoint:  # the state tensors are the retained views: only hyper-parameters move
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
                apply_param_groups(optimizer, state["param_groups"])

    def resolve_fit_ckpt_path(self, ckpt_path: Any, trainer: pl.Trainer | None = None) -> Any:
        """As ``LetoStrategy.resolve_fit_ckpt_path`` (``fit_hooks.begin_fit``); a checkpoint file is
        a distributed checkpoint (``ModelParallelStrategy``'s format), loaded into a new store."""
        return begin_fit(self, ckpt_path, trainer)

    # -- the end -------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        trainer = attached_trainer(self.lightning_module)
        ends_fit = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        try:
            super().teardown()
            if ends_fit and trainer is not None and self.retained is not None and not resume_can_follow(self, trainer):
                self.release(unlink=True)
        finally:
            self._proxy = None
            self.fit_state.end()

    def release(self, unlink: bool = False) -> None:
        """Copy the shards out of retained memory (the model stays usable), then drop this
        process's mappings; ``unlink=True`` also frees the job's retained memory."""
        if self.sharded is not None:
            self.sharded.detach()
            self.sharded = None
        release(self, unlink)


LetoModelParallelStrategy.register_strategies(StrategyRegistry)
