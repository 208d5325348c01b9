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
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.migration import migrate_checkpoint
from typing_extensions import override

from ...errors import ConfigurationError
from ...retained.config import RetainedConfig
from ...retained.store import RetainedStore, StoreSpec
from ...updater.retained_optimizer import RetainedOptimizer, config_for
from .checks import check_trainer, reject_ddp_options
from .fit_hooks import LetoFitHooks, file_payload, leto_settings
from .fit_state import FitMode
from .internals import ddp_init_sync_off
from .options import RETAINED_CKPT
from .proxy import proxy_for
from .resume import apply_param_groups, restore_callbacks
from .zero1 import after_adopt, before_free, retained_for, store_layout, zero1_partition

STRATEGY_NAME = "leto"
log = logging.getLogger(__name__)


class LetoStrategy(LetoFitHooks, DDPStrategy):
    """DDP with retained optimizer state and crash-consistent updates (module doc).

    Retained-memory options (``page_bytes``, ``chunk_pages``, ``data_pages``, ``tier1_parity``,
    ``tier2_parity``, ... -- every ``RetainedConfig`` field) may be given one by one or as
    ``retained=RetainedConfig(...)``; runtime options are ``LetoRuntimeOptions``'s. Both are
    validated here. ``keep_retained=True`` keeps the retained memory after a fit that would
    free it (see ``_resume_can_follow``). Other keyword arguments go to ``DDPStrategy``.
    """

    strategy_name = STRATEGY_NAME
    leto_description = "Leto: DDP with retained optimizer state and in-place recovery"

    def __init__(self, *, retained: RetainedConfig | None = None, job_id: str | None = None,
                 resume: str | None = None, shadow_level: int | str = 3, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 60.0, keep_retained: bool = False, **kwargs: Any) -> None:
        settings = leto_settings(kwargs, retained, job_id, resume, shadow_level, heartbeat_interval,
                                 heartbeat_timeout)
        reject_ddp_options(kwargs)
        super().__init__(**kwargs)
        self._leto_state(settings, keep_retained)
        self._optimizers_ready = False

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # build the retained checkpoint once the store is bound

    @override
    def setup_distributed(self) -> None:
        self._session_group_or(super().setup_distributed)

    # -- setup -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_trainer(self, trainer)
            self._install_loop_state(trainer)
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
            self.resume_payload = self.engine.resume()  # a level-3 shadow waits here, fully built
            after_adopt(ro)  # ZeRO-1: the owners' views are final now; replicas from them before the first forward
            self.logs.continue_from(trainer, self.resume_payload)
            return
        if mode is FitMode.FROM_RETAINED:
            self.resume_payload = self.engine.resume()
        self.logs.continue_from(trainer, self.resume_payload)  # a resume or a checkpoint file continues the logs
        super().configure_ddp()  # broadcasts rank 0's parameters into every rank's views
        if mode is not FitMode.FROM_RETAINED:
            # Checksums and parity of a new store describe what the broadcast left, not the
            # rank's own initial weights it replaced: tier 1 again, then the store is complete.
            self.engine.complete(lambda: self.barrier("leto-stores-bound"), reencode=True)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        if self._optimizers_ready:  # created in configure_ddp, before the wrap
            self._optimizers_ready = False
            return
        super().setup_optimizers(trainer)

    def _bind_retained(self, trainer: pl.Trainer) -> None:
        optimizer = self._begin_binding(trainer)
        payload, barrier = self._payload_fn(trainer), self._prepare_barrier()
        module = self.module
        assert self.job_id is not None  # _begin_binding
        # Manual optimization steps inside training_step: the update stays open (rolled back by
        # recovery) until the batch ends, which needs the whole-state undo copy (docs/lightning.md).
        manual = not module.automatic_optimization
        split = zero1_partition(optimizer, module, manual=manual)  # ZeRO-1
        if self.fit_state.mode.from_retained_memory:
            def attach(store: RetainedStore) -> RetainedOptimizer:
                ro = retained_for(optimizer, store, barrier, payload, manual, split)
                ro.bind(adopt=True, resume=False)  # views only: resume() once promoted (configure_ddp)
                return ro

            ro = self.engine.attach(self.job_id, self.global_rank, attach)
            if self.fit_state.mode is FitMode.FROM_RETAINED:  # a shadow refreshes once promoted (configure_ddp)
                after_adopt(ro)  # ZeRO-1: replicas from the owners, before DDP's broadcast from rank 0
        else:
            iteration, self.resume_payload = self._load_checkpoint_file(trainer, optimizer)
            config = config_for(self.retained_config, optimizer)
            config.check_devices(self.num_processes)
            names = {p: n for n, p in module.named_parameters()}
            spec = StoreSpec(self.job_id, self.global_rank, self.node_rank, self.local_rank, self.num_processes,
                             store_layout(optimizer, config, names, manual, split), config,
                             replica_shards=1 if split is None else 0)  # DDP replicas; ZeRO-1: one rank's

            def bind(store: RetainedStore) -> RetainedOptimizer:
                ro = retained_for(optimizer, store, barrier, payload, manual, split)
                # A checkpoint's weights and optimizer state move into the new store, which starts at
                # its global step with its payload committed (a crash before the next step resumes there).
                ro.bind(adopt=False, iteration=iteration, payload=self.resume_payload)
                return ro

            # completed after DDP's broadcast (configure_ddp)
            ro = self.engine.create(spec, bind, barrier=barrier, complete=False,
                                    attach_with=f"trainer.fit(ckpt_path={RETAINED_CKPT!r}) or LETO_RESUME=retained")
        optimizer.zero_grad = ro.zero_grad  # type: ignore[method-assign]  # in place: the gradients stay retained views
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
            raise ConfigurationError(f"{path}: LetoStrategy resumes a checkpoint of exactly one optimizer")
        self.module.load_state_dict(ckpt["state_dict"], strict=self.module.strict_loading)
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        ckpt["leto_file"] = str(path)
        self._file_checkpoint = ckpt
        return int(ckpt.get("global_step", 0)), file_payload(ckpt)

    def _binding_step(self, closure: Callable | None) -> Any:
        assert self.retained is not None
        return self.retained.step(closure)

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def _on_resumed(self, kind: str | None) -> None:
        """DDP broadcasts rank 0's buffers (BatchNorm statistics) at the first forward of a new
        wrapper, later only after forwards that synchronised gradients -- never in manual
        optimization, where Lightning turns the reducer off during forward. A resumed manual run
        must not broadcast either, or every other rank's statistics become rank 0's."""
        if kind not in (None, "start") and not self.module.automatic_optimization and isinstance(
                self.model, torch.nn.parallel.DistributedDataParallel):
            self.model.require_forward_param_sync = False

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self._checkpoint_saved(checkpoint)

    # -- resume --------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        ckpt_file = self._file_checkpoint
        if ckpt_file is not None and str(checkpoint_path) == ckpt_file["leto_file"]:
            self._file_checkpoint = None  # weights and optimizer state are in retained memory already
            # without a Leto payload: Lightning's own restore
            ckpt = ckpt_file if self.resume_payload is None else self._payload_checkpoint()
            if ckpt_file.get("leto_callbacks_restored"):
                ckpt.pop("callbacks", None)  # restored before on_fit_start (_restore_file_callbacks)
            return ckpt
        if str(checkpoint_path) != RETAINED_CKPT:
            return super().load_checkpoint(checkpoint_path, weights_only)
        return self._retained_checkpoint()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if "leto" not in checkpoint and "leto_file" not in checkpoint:
            super().load_optimizer_state_dict(checkpoint)
            return
        # The state tensors are the retained views already: only hyper-parameters move.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            apply_param_groups(optimizer, state["param_groups"])

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


LetoStrategy.register_strategies(StrategyRegistry)  # idempotent; see __init__.register
