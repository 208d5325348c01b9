"""``LetoStrategy``: Lightning DDP whose optimizer state lives in retained memory.

What it changes in ``DDPStrategy`` (each measured against Lightning 2.6.6; see
docs/lightning.md):

- ``configure_ddp`` -- after ``model_to_device``, *before* the DDP wrap: create the optimizer,
  create (or, resuming, attach) the rank's ``RetainedStore`` and bind parameters, gradients and
  optimizer state to views into it. DDP then broadcasts into and reduces into retained memory.
- ``optimizer_step`` -- the precision plugin steps a proxy (``proxy.py``) whose ``step(closure)``
  runs the closure, then the chunk transactions; the real ``optimizer.step`` (wrapped by LR
  schedulers) is never replaced.
- ``process_dataloader`` -- the training loader becomes a ``ResumableDataLoader``.
- ``load_checkpoint("leto://retained")`` -- an in-memory checkpoint built from the store and its
  resume payload (``resume.py``); restore runs after ``setup`` so the store is already bound.
- launcher (``launcher.py``) -- never starts processes (Lightning's launcher kills every rank
  when one dies); turns ``LETO_RESUME=retained`` into ``ckpt_path="leto://retained"``.
- ``checks.py`` -- combinations it cannot protect are rejected at construction or setup.
- under ``leto launch`` (``LETO_ROLE`` set): ``runtime_link.py`` -- the session's process group,
  store creation/attach, promotion wait, heartbeats and progress keys; ``logs.py`` -- loggers
  continued across trainer processes and the recovery metrics.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.migration import migrate_checkpoint
from typing_extensions import override

from ...env import ProcessSettings
from ...errors import UsageError
from ...retained.config import RetainedConfig
from ...retained.store import RetainedStore, StoreSpec
from ...runtime.link import RuntimeLink
from ...updater.retained_optimizer import RetainedOptimizer, complete_new_store, config_for, encode_all
from .callback import LetoLoopStateCallback
from .checks import check_trainer, reject_ddp_options, the_optimizer
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
from .internals import attached_trainer, ddp_init_sync_off, set_launcher, set_process_group_backend
from .launcher import LetoLauncher, check_launch
from .logs import LogKeeper
from .options import RETAINED_CKPT
from .proxy import proxy_for, real_optimizer
from .resume import apply_param_groups, restore_callbacks
from .versions import check_lightning
from .zero1 import after_adopt, before_free, retained_for, stepped_optimizer, store_layout, zero1_partition

STRATEGY_NAME = "leto"
log = logging.getLogger(__name__)


class LetoStrategy(DDPStrategy):
    """DDP with retained optimizer state and crash-consistent updates (module doc).

    Retained-memory options (``page_bytes``, ``chunk_pages``, ``data_pages``, ``tier1_parity``,
    ``tier2_parity``, ... -- every ``RetainedConfig`` field) may be given one by one or as
    ``retained=RetainedConfig(...)``; runtime options are ``LetoRuntimeOptions``'s. Both are
    validated here. ``keep_retained=True`` keeps the retained memory after a fit that would
    free it (see ``_resume_can_follow``). Other keyword arguments go to ``DDPStrategy``.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *, retained: RetainedConfig | None = None, job_id: str | None = None,
                 resume: str | None = None, shadow_level: int | str = 3, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 60.0, keep_retained: bool = False, **kwargs: Any) -> None:
        check_lightning()  # at Trainer(...): an untested Lightning is refused before anything runs
        settings = leto_settings(kwargs, retained, job_id, resume, shadow_level, heartbeat_interval,
                                 heartbeat_timeout)
        self.retained_config, self.leto_options = settings.retained, settings.options
        reject_ddp_options(kwargs)
        self.runtime: RuntimeLink | None = settings.runtime  # under `leto launch`: the session
        super().__init__(**kwargs)
        self.logs = LogKeeper()
        self.loop_state = LetoLoopStateCallback()
        self.loop_state.attach(self)
        self.retained: RetainedOptimizer | None = None
        self.keep_retained = keep_retained  # keep the store after any fit (your own recovery): _resume_can_follow
        self.job_id: str | None = None
        self.fit_state = FitState()  # the fit mode and the batch phase (fit_state.py)
        self._proxy: torch.optim.Optimizer | None = None
        self._file_checkpoint: dict | None = None
        self.env_resume_used = False
        self.resume_payload: Any = None
        self.resumed_from: dict | None = None  # build_checkpoint's "leto" entry: what on_train_start restores
        self._optimizers_ready = False
        self.train_loaders: weakref.WeakSet[ResumableDataLoader] = weakref.WeakSet()

    @override
    def __getstate__(self) -> dict[str, Any]:
        """A pickled or deep-copied strategy (``torch.save(trainer)``, ``copy.deepcopy``) is a
        detached copy, as a pickled DDP strategy is: no retained memory, step proxy, loaders or
        link to ``leto launch`` travel with it -- those belong to this process's fit -- and its
        next fit decides its mode anew."""
        return dict(super().__getstate__(), retained=None, _proxy=None, runtime=None, train_loaders=None,
                    fit_state=self.fit_state.detached())

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.train_loaders = weakref.WeakSet()

    # -- registration ----------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"leto"`` once; the inherited method would re-register every ``ddp*`` name."""
        entry = dict.get(strategy_registry, STRATEGY_NAME)  # the registry's own get() instantiates
        if entry is None or getattr(entry["strategy"], "leto_factory", False):  # or the package's import-time one
            strategy_registry.register(STRATEGY_NAME, cls, override=True,
                                       description="Leto: DDP with retained optimizer state and in-place recovery")

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # build the retained checkpoint once the store is bound

    @property
    def module(self) -> pl.LightningModule:
        """The module of the running fit (Lightning's ``lightning_module``, known to be set)."""
        module = self.lightning_module
        if module is None:
            raise UsageError("LetoStrategy: no LightningModule is connected (this runs inside trainer.fit())")
        return module

    @property
    def retained_active(self) -> bool:
        return self.retained is not None

    @property
    def committed_any(self) -> bool:
        return self.retained is not None and self.retained.iteration > 0

    @override
    def _configure_launcher(self) -> None:
        check_launch(self)  # at Trainer(...): Leto never spawns ranks; say how to start them
        set_launcher(self, LetoLauncher(self))

    # -- environment -------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        if self.runtime is not None:
            self.runtime.connect()  # shadows at level 1/2 wait here until promoted
        super().setup_environment()  # accelerator, then setup_distributed
        prepare_logs(self)

    @override
    def setup_distributed(self) -> None:
        if self.runtime is None:
            super().setup_distributed()
            return
        set_process_group_backend(self)
        init_session_group(self, self.runtime)

    # -- setup -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_trainer(self, trainer)
            install_loop_state(self, trainer)
        super().setup(trainer)
        self._restore_file_callbacks(trainer)

    def _restore_file_callbacks(self, trainer: pl.Trainer) -> None:
        """``fit(ckpt_path=<file>)``: the callbacks' state from the file now, before
        ``on_fit_start``, where "ddp" restores it (``restore_checkpoint_after_setup`` is False
        there); the rest of the restore follows after setup (``load_checkpoint``), once."""
        ckpt = self._file_checkpoint
        if ckpt is None or "callbacks" not in ckpt:
            return
        restore_callbacks(trainer, ckpt)
        ckpt["leto_callbacks_restored"] = True

    @override
    def configure_ddp(self) -> None:
        """Bind to retained memory before the DDP wrap: DDP then broadcasts into the views and
        its reducer writes gradients into retained memory."""
        trainer = self.module.trainer
        super().setup_optimizers(trainer)
        self._optimizers_ready = True
        self._bind_retained(trainer)
        ro = self.retained
        assert ro is not None
        mode = self.fit_state.mode
        if mode is FitMode.SHADOW:
            # A shadow is built up to here while the active trainers still write the same
            # memory: DDP must not broadcast into it. After promotion every rank's retained
            # parameters are the same committed values, so no broadcast is needed at all.
            with ddp_init_sync_off(self):
                super().configure_ddp()
            assert self.runtime is not None  # SHADOW: under leto launch
            self.runtime.wait_for_promotion()  # a level-3 shadow waits here, fully built
            self.resume_payload = ro.resume()
            after_adopt(ro)  # ZeRO-1: the owners' views are final now; replicas from them before the first forward
            self.logs.continue_from(trainer, self.resume_payload)
            return
        if mode is FitMode.FROM_RETAINED:
            self.resume_payload = ro.resume()
        self.logs.continue_from(trainer, self.resume_payload)  # a resume or a checkpoint file continues the logs
        super().configure_ddp()  # broadcasts rank 0's parameters into every rank's views
        if mode is not FitMode.FROM_RETAINED:
            # Checksums and parity of a new store describe what the broadcast left, not the
            # rank's own initial weights it replaced.
            encode_all(ro.store, ro.txn.codes)
            complete_new_store(ro.store, lambda: self.barrier("leto-stores-bound"))
            if self.runtime is not None:
                self.runtime.store_ready()  # shadows may attach now

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if self._optimizers_ready:  # created in configure_ddp, before the wrap
            self._optimizers_ready = False
            return
        super().setup_optimizers(trainer)

    def _bind_retained(self, trainer: pl.Trainer) -> None:
        optimizer = the_optimizer(self, trainer)
        self.job_id = self.leto_options.resolved_job_id() or self.job_id or agreed_new_job_id(self)
        payload = payload_fn(self, trainer)
        module = self.module
        # Manual optimization steps inside training_step: the update stays open (rolled back by
        # recovery) until the batch ends, which needs the whole-state undo copy (docs/lightning.md).
        manual = not module.automatic_optimization
        if self.fit_state.mode is FitMode.NONE:  # a fit the launcher did not see (no resolve_fit_ckpt_path)
            self.fit_state.begin(FitMode.FRESH)
        split = zero1_partition(optimizer, module, manual=manual)  # ZeRO-1
        if self.fit_state.mode.from_retained_memory:
            if self.runtime is not None:
                self.runtime.wait_for_store()  # a shadow starts beside the active that creates it
            store = RetainedStore.attach(self.job_id, self.global_rank)
            ro = retained_for(optimizer, store, prepare_barrier(self), payload, manual, split)
            ro.bind(adopt=True, resume=False)  # views only: resume() once promoted (configure_ddp)
            if self.fit_state.mode is FitMode.FROM_RETAINED:  # a shadow refreshes once promoted (configure_ddp)
                after_adopt(ro)  # ZeRO-1: replicas from the owners, before DDP's broadcast from rank 0
        else:
            iteration, self.resume_payload = self._load_checkpoint_file(trainer, optimizer)
            config = config_for(self.retained_config, optimizer)
            config.check_devices(self.num_processes)
            names = {p: n for n, p in module.named_parameters()}
            spec = StoreSpec(self.job_id, self.global_rank, self.node_rank, self.local_rank, self.num_processes,
                             store_layout(optimizer, config, names, manual, split), config)
            store = _create_store(spec)
            ro = retained_for(optimizer, store, prepare_barrier(self), payload, manual, split)
            # A checkpoint's weights and optimizer state move into the new store, which starts at
            # its global step with its payload committed (a crash before the next step resumes there).
            ro.bind(adopt=False, iteration=iteration, payload=self.resume_payload)
        optimizer.zero_grad = ro.zero_grad  # type: ignore[method-assign]  # in place: the gradients stay retained views
        self.retained = ro
        self._proxy = proxy_for(optimizer, self._retained_step)

    def _load_checkpoint_file(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> tuple[int, Any]:
        """``fit(ckpt_path=<file>)``: load weights and optimizer state *before* binding (the
        bind copies them into retained memory). Returns (global step, resume payload or None)."""
        self._file_checkpoint = None
        path = self.fit_state.ckpt_file  # resolved as Lightning resolves it (resolve_fit_ckpt_path)
        if path is None:
            return 0, None
        ckpt = self.checkpoint_io.load_checkpoint(path, weights_only=True)  # type: ignore[arg-type]  # a str or Path  # tensors and plain values only
        ckpt, _ = migrate_checkpoint(ckpt)  # as Lightning upgrades a file it loads (callback keys, loops)
        if len(ckpt.get("optimizer_states", ())) != 1:
            raise ValueError(f"{path}: LetoStrategy resumes a checkpoint of exactly one optimizer")
        self.module.load_state_dict(ckpt["state_dict"], strict=self.module.strict_loading)
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        ckpt["leto_file"] = str(path)
        self._file_checkpoint = ckpt
        return int(ckpt.get("global_step", 0)), file_payload(ckpt)

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        ro = self.retained
        if ro is None or real_optimizer(optimizer) is not stepped_optimizer(ro):
            raise RuntimeError("LetoStrategy: this optimizer is not bound to retained memory (created outside "
                               "configure_optimizers?); it would train without protection")
        assert self._proxy is not None  # made with the binding
        return super().optimizer_step(self._proxy, closure, model, **kwargs)

    def _retained_step(self, closure: Callable | None) -> Any:
        """The proxy's ``step``: closure (forward, backward, clipping), then the transactions."""
        assert self.retained is not None
        return retained_step(self, closure, self.retained.step)

    def record_payload(self, payload: Any) -> None:
        """Replace the resume payload of the last committed iteration (``fit_hooks.record_payload``)."""
        record_payload(self, payload)

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        resumed, self.resumed_from = self.resumed_from or {}, None
        self._continue_buffer_sync(resumed.get("kind"))
        train_start(self, resumed)

    def _continue_buffer_sync(self, kind: str | None) -> None:
        """DDP broadcasts rank 0's buffers (BatchNorm statistics) at the first forward of a new
        wrapper, later only after forwards that synchronised gradients -- never in manual
        optimization, where Lightning turns the reducer off during forward. A resumed manual run
        must not broadcast either, or every other rank's statistics become rank 0's."""
        if kind not in (None, "start") and not self.module.automatic_optimization and isinstance(
                self.model, torch.nn.parallel.DistributedDataParallel):
            self.model.require_forward_param_sync = False

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
        """A named point between steps (validation, epoch end, after a checkpoint save): a
        heartbeat at most every interval, and where tests inject faults under ``leto launch``."""
        fault_point(self, name, phase)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoint_saved(self, checkpoint, self.is_global_zero)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return wrap_train_loader(self, super().process_dataloader(dataloader))

    # -- resume --------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        ckpt_file = self._file_checkpoint
        if ckpt_file is not None and str(checkpoint_path) == ckpt_file["leto_file"]:
            self._file_checkpoint = None  # weights and optimizer state are in retained memory already
            # without a Leto payload: Lightning's own restore
            ckpt = ckpt_file if self.resume_payload is None else payload_checkpoint(self)
            if ckpt_file.get("leto_callbacks_restored"):
                ckpt.pop("callbacks", None)  # restored before on_fit_start (_restore_file_callbacks)
            return ckpt
        if str(checkpoint_path) != RETAINED_CKPT:
            return super().load_checkpoint(checkpoint_path, weights_only)
        check_retained_resume(self)
        return payload_checkpoint(self)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if "leto" not in checkpoint and "leto_file" not in checkpoint:
            super().load_optimizer_state_dict(checkpoint)
            return
        # The state tensors are the retained views already: only hyper-parameters move.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            apply_param_groups(optimizer, state["param_groups"])

    @override
    def teardown(self) -> None:
        trainer = attached_trainer(self.lightning_module)
        ends_fit = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        try:
            super().teardown()
            if ends_fit and trainer is not None and self.retained is not None and not self._resume_can_follow(trainer):
                self._free_retained()
        finally:  # even after an error here, the next fit in this process decides its mode anew
            self._proxy = None
            self.fit_state.end()
            self._file_checkpoint = None

    def _resume_can_follow(self, trainer: pl.Trainer) -> bool:
        return resume_can_follow(self, trainer)  # fit_hooks.resume_can_follow says when

    def _free_retained(self) -> None:
        """Copy parameters, gradients and optimizer state out of retained memory (the module and
        the optimizer stay usable: ``trainer.test()``, ``state_dict()``), then free the store."""
        ro = self.retained
        assert ro is not None
        with torch.no_grad():
            for p in ro.params:
                p.data = p.data.clone()
                if p.grad is not None:
                    p.grad = p.grad.clone()
            for state in ro.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.clone()
        ro.optimizer.__dict__.pop("zero_grad", None)  # the instance attribute _bind_retained set
        before_free(ro)
        self.release(unlink=True)

    def release(self, unlink: bool = False) -> None:
        """Drop this process's mappings; ``unlink=True`` also frees the job's retained memory
        (only when no shadow or agent will need it any more)."""
        release(self, unlink)

    def resolve_fit_ckpt_path(self, ckpt_path: Any, trainer: pl.Trainer | None = None) -> Any:
        """Decide (in the launcher, before Lightning resolves ``ckpt_path``) whether this fit
        continues from retained memory, from a checkpoint file, or starts fresh; returns the
        ckpt_path Lightning should see.

        Under ``leto launch`` a shadow or cold restart continues from retained memory whatever
        ``ckpt_path`` the script passes (a script that always says ``ckpt_path="last"`` works).
        A file ("last", "best", a path) is resolved here exactly as Lightning resolves it, so
        ``configure_ddp`` loads the file Lightning will restore the loops from."""
        return begin_fit(self, ckpt_path, trainer)


def _create_store(spec: StoreSpec) -> RetainedStore:
    try:
        return RetainedStore.create(spec, ProcessSettings.from_env())
    except FileExistsError:
        raise RuntimeError(
            f"retained memory of job {spec.job_id!r} rank {spec.rank} already exists: continue from it with "
            f"trainer.fit(ckpt_path={RETAINED_CKPT!r}) (or LETO_RESUME=retained), or free it with "
            f"leto_lightning.retained.shm.unlink_segments({spec.job_id!r}) to start over") from None


LetoStrategy.register_strategies(StrategyRegistry)  # idempotent; see __init__.register
