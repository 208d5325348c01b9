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

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from ...errors import UsageError
from ...faults.points import point
from ...retained.config import RetainedConfig
from ...retained.shm import new_job_id
from ...retained.store import RetainedStore, StoreSpec
from ...runtime.link import RuntimeLink
from ...updater.retained_optimizer import RetainedOptimizer, encode_all, encode_tier2, layout_for
from ...updater.transaction import ParityCodes
from .callback import LetoLoopStateCallback
from .checks import check_trainer, reject_ddp_options, the_optimizer
from .data import ResumableDataLoader
from .environment import LetoEnvironment, under_leto_launch
from .fit_state import FitMode, FitState
from .frozen import FrozenPayload
from .launcher import LetoLauncher, check_launch
from .logs import LogKeeper
from .options import RETAINED_CKPT, LetoRuntimeOptions
from .plateau import restore_monitored
from .proxy import proxy_for, real_optimizer
from .resume import apply_param_groups, build_checkpoint, capture, set_rng_states
from .versions import check_lightning

_RETAINED_FIELDS = frozenset(f.name for f in dataclasses.fields(RetainedConfig))
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
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _RETAINED_FIELDS}
        if retained is not None and fields:
            raise ValueError(f"pass retained=RetainedConfig(...) or {sorted(fields)}, not both")
        self.retained_config = retained if retained is not None else RetainedConfig(**fields)
        self.leto_options = LetoRuntimeOptions(job_id, resume, LetoRuntimeOptions.parse_level(shadow_level),
                                               heartbeat_interval, heartbeat_timeout)
        reject_ddp_options(kwargs)
        # Under `leto launch` the agent owns ranks, store and process-group namespace.
        self.runtime: RuntimeLink | None = RuntimeLink(heartbeat_interval) if under_leto_launch() else None
        if self.runtime is not None and kwargs.get("cluster_environment") is None:
            kwargs["cluster_environment"] = LetoEnvironment()
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
        self._env_resume_used = False
        self._resume_payload: Any = None
        self._resumed_from: dict | None = None  # build_checkpoint's "leto" entry: what on_train_start restores
        self._optimizers_ready = False
        self._train_loaders: weakref.WeakSet[ResumableDataLoader] = weakref.WeakSet()

    @override
    def __getstate__(self) -> dict[str, Any]:
        """A pickled or deep-copied strategy (``torch.save(trainer)``, ``copy.deepcopy``) is a
        detached copy, as a pickled DDP strategy is: no retained memory, step proxy, loaders or
        link to ``leto launch`` travel with it -- those belong to this process's fit -- and its
        next fit decides its mode anew."""
        return dict(super().__getstate__(), retained=None, _proxy=None, runtime=None, _train_loaders=None,
                    fit_state=self.fit_state.detached())

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._train_loaders = weakref.WeakSet()

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
        self._launcher = LetoLauncher(self)

    # -- environment -------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        if self.runtime is not None:
            self.runtime.connect()  # shadows at level 1/2 wait here until promoted
        super().setup_environment()  # accelerator, then setup_distributed
        module = self._lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # before Lightning creates experiments
            continues = self.fit_state.mode.continues  # (without leto launch)
            self.logs.prepare(trainer, self.runtime, self.global_rank, continues)

    @override
    def setup_distributed(self) -> None:
        if self.runtime is None:
            super().setup_distributed()
            return
        # Not Lightning's _init_dist_connection: the agent already listens on MASTER_PORT, and the
        # group must live under the session's generation (or shadow-set) prefix.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if not torch.distributed.is_initialized():
            timeout = self._timeout if self._timeout is not None else default_pg_timeout
            self.runtime.init_process_group(self._process_group_backend, timeout.total_seconds())

    # -- setup -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_trainer(self, trainer)
            callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
            if self.loop_state in callbacks:
                callbacks.remove(self.loop_state)
            callbacks.append(self.loop_state)  # last: sees what the other callbacks did
        super().setup(trainer)

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
            self._ddp_kwargs["init_sync"] = False
            try:
                super().configure_ddp()
            finally:
                self._ddp_kwargs.pop("init_sync", None)
            assert self.runtime is not None  # SHADOW: under leto launch
            self.runtime.wait_for_promotion()  # a level-3 shadow waits here, fully built
            self._resume_payload = ro.resume()
            self.logs.continue_from(trainer, self._resume_payload)
            return
        if mode is FitMode.FROM_RETAINED:
            self._resume_payload = ro.resume()
        self.logs.continue_from(trainer, self._resume_payload)  # a resume or a checkpoint file continues the logs
        super().configure_ddp()  # broadcasts rank 0's parameters into every rank's views
        if mode is not FitMode.FROM_RETAINED:
            # Checksums and parity of a new store describe what the broadcast left, not the
            # rank's own initial weights it replaced.
            encode_all(ro.store, ro.txn.codes)
            self._encode_node_parity(ro.store)
            ro.store.mark_complete()  # set-up done: recovery may trust the store from here on
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
        self.job_id = self.leto_options.resolved_job_id() or self.job_id or self._agreed_new_job_id()

        def payload_fn() -> FrozenPayload:  # pickled once: the prepare and commit records write the same payload
            return FrozenPayload(self.loop_state.payload_at_prepare(trainer))

        module = self.module
        # Manual optimization steps inside training_step: the update stays open (rolled back by
        # recovery) until the batch ends, which needs the whole-state undo copy (docs/lightning.md).
        manual = not module.automatic_optimization
        if self.fit_state.mode is FitMode.NONE:  # a fit the launcher did not see (no resolve_fit_ckpt_path)
            self.fit_state.begin(FitMode.FRESH)
        if self.fit_state.mode.from_retained_memory:
            if self.runtime is not None:
                self.runtime.wait_for_store()  # a shadow starts beside the active that creates it
            store = RetainedStore.attach(self.job_id, self.global_rank)
            ro = RetainedOptimizer(optimizer, store, self._prepare_barrier(), payload_fn, rollback_window=manual)
            ro.bind(adopt=True, resume=False)  # views only: resume() once promoted (configure_ddp)
        else:
            iteration, self._resume_payload = self._load_checkpoint_file(trainer, optimizer)
            config = self.retained_config
            config.check_devices(self.num_processes)
            names = {p: n for n, p in module.named_parameters()}
            spec = StoreSpec(self.job_id, self.global_rank, self.node_rank, self.local_rank, self.num_processes,
                             layout_for(optimizer, config, names, whole_state=manual), config)
            store = _create_store(spec)
            ro = RetainedOptimizer(optimizer, store, self._prepare_barrier(), payload_fn, rollback_window=manual)
            # A checkpoint's weights and optimizer state move into the new store, which starts at
            # its global step with its payload committed (a crash before the next step resumes there).
            ro.bind(adopt=False, iteration=iteration, payload=self._resume_payload)
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
        if len(ckpt.get("optimizer_states", ())) != 1:
            raise ValueError(f"{path}: LetoStrategy resumes a checkpoint of exactly one optimizer")
        self.module.load_state_dict(ckpt["state_dict"], strict=self.module.strict_loading)
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        ckpt["leto_file"] = str(path)
        self._file_checkpoint = ckpt
        payload = (ckpt.get("callbacks", {}).get("LetoLoopStateCallback") or {}).get("payload")
        return int(ckpt.get("global_step", 0)), payload

    def _encode_node_parity(self, store: RetainedStore) -> None:
        """Tier 2 spans the node's ranks: once every local rank has bound its store, local rank
        0 encodes the stripes from all of them (each rank then keeps them current by deltas)."""
        if not store.spec.tier2.enabled:
            return
        self.barrier("leto-stores-bound")
        if self.local_rank == 0:
            first = self.global_rank - self.local_rank
            peers = [RetainedStore.attach(store.spec.job_id, first + i) for i in range(1, self.num_processes)]
            try:
                encode_tier2([store, *peers], ParityCodes(store))
            finally:
                for peer in peers:
                    peer.close()
        self.barrier("leto-tier2-encoded")

    def _agreed_new_job_id(self) -> str:
        """A fresh job id, the same on every rank (rank 0's): tier 2 attaches the peers' stores."""
        job = new_job_id()
        if self.world_size > 1 and torch.distributed.is_initialized():
            job = self.broadcast(job, src=0)
        return job

    def _prepare_barrier(self) -> Callable[[], None] | None:
        """No chunk of an iteration commits before every rank prepared it (docs/design.md 2.3)."""
        if self.runtime is not None:
            return self.runtime.barrier  # the session's flag all-reduce
        if self.world_size <= 1:
            return None
        return lambda: torch.distributed.barrier()

    # -- the step ----------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        ro = self.retained
        if ro is None or real_optimizer(optimizer) is not ro.optimizer:
            raise RuntimeError("LetoStrategy: this optimizer is not bound to retained memory (created outside "
                               "configure_optimizers?); it would train without protection")
        assert self._proxy is not None  # made with the binding
        return super().optimizer_step(self._proxy, closure, model, **kwargs)

    def _retained_step(self, closure: Callable | None) -> Any:
        """The proxy's ``step``: closure (forward, backward, clipping), then the transactions."""
        ro = self.retained
        assert ro is not None
        link = self.runtime
        if link is not None and closure is not None:
            inner = closure

            def closure() -> Any:  # forward and backward, then the agent hears "update"
                out = inner()
                link.update_start(ro.iteration)
                return out
        elif link is not None:  # 16-mixed: the precision plugin ran the closure before the scaler's step
            link.update_start(ro.iteration)
        loss = ro.step(closure)
        ro.optimizer._opt_called = True  # type: ignore[attr-defined]  # what the LR scheduler's step wrapper sets
        self.fit_state.step_committed()
        if link is not None:
            link.step_done(ro.iteration - 1)
        return loss

    def record_payload(self, payload: Any) -> None:
        """Replace the resume payload of the last committed iteration (same iteration, newer
        payload; the record's two slots keep the previous one until this write is complete)."""
        ro = self.retained
        assert ro is not None
        # Manual optimization keeps it to write again (as "before"); there the record also seals
        # the batch's update (kept from here on).
        ro.record_committed(FrozenPayload(payload))

    # -- hooks ---------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        trainer = self.module.trainer
        resumed, self._resumed_from = self._resumed_from or {}, None
        self._continue_buffer_sync(resumed.get("kind"))
        restore_monitored(trainer, resumed.get("monitored") or {})
        if resumed.get("rng") is not None:
            set_rng_states(resumed["rng"])  # last thing before the first batch: as the crashed run
        # before "start": a fresh run's payload counts no rows yet
        self.logs.on_train_start(trainer, self.retained.iteration if self.retained is not None else None)
        if self.retained is not None and self.retained.iteration == 0:
            self.record_payload(capture(trainer, "start"))
        if self.runtime is not None and self.runtime.resume_pending and self.retained is not None:
            self.runtime.resumed(self.retained.iteration)  # loop, RNG and data position are restored

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
        self.fit_state.batch_started()
        trainer = self.module.trainer
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        for loader in list(self._train_loaders):
            loader.mark(batch_idx + 1, last)
        if self.runtime is not None and self.retained is not None:
            self.logs.log_recoveries(trainer)
            self.runtime.batch_start(self.retained.iteration)

    @override
    def on_train_end(self) -> None:
        if self.runtime is not None:
            self.logs.finish(self.module.trainer)
            if self.runtime.session is not None:
                self.runtime.session.mark_finished()  # a crash during interpreter exit is no failure

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.runtime is not None:
            self.runtime.report_exception(exception)
        super().on_exception(exception)

    def fault_point(self, name: str, phase: str) -> None:
        """A named point between steps (validation, epoch end, after a checkpoint save): a
        heartbeat at most every interval, and where tests inject faults under ``leto launch``."""
        if self.runtime is not None and self.retained is not None:
            self.runtime.alive(self.retained.iteration - 1, phase)
        point(name)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.runtime is not None and self.is_global_zero:
            self.logs.checkpoint_saved(self.runtime, int(checkpoint.get("global_step", 0)))
        self.fault_point("lightning.after_checkpoint", "checkpoint")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        module = self._lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        wrapped = ResumableDataLoader(dataloader)
        if wrapped.unreplayable_order():
            rank_zero_warn("LetoStrategy: the training DataLoader shuffles with an unseeded RandomSampler; a resume "
                           "mid-epoch cannot replay its order. Pass DataLoader(generator=...) or keep "
                           "use_distributed_sampler=True.")
        self._train_loaders.add(wrapped)
        return wrapped

    # -- resume --------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        ckpt_file = self._file_checkpoint
        if ckpt_file is not None and str(checkpoint_path) == ckpt_file["leto_file"]:
            self._file_checkpoint = None  # weights and optimizer state are in retained memory already
            if self._resume_payload is None:  # a checkpoint without a Leto payload: Lightning's own restore
                return ckpt_file
            return self._payload_checkpoint()
        if str(checkpoint_path) != RETAINED_CKPT:
            return super().load_checkpoint(checkpoint_path, weights_only)
        if not self.fit_state.mode.from_retained_memory or self.retained is None:
            raise RuntimeError(f"ckpt_path={RETAINED_CKPT!r} resumes training from retained memory: use it with "
                               "trainer.fit() on a Trainer with LetoStrategy")
        return self._payload_checkpoint()

    def _payload_checkpoint(self) -> dict[str, Any]:
        """The in-memory checkpoint of the resume payload (from retained memory or a checkpoint
        file); what Lightning's restore does not cover is kept for ``on_train_start``."""
        ckpt = build_checkpoint(self.module.trainer, self._resume_payload)
        self._resumed_from = ckpt["leto"]
        self.fit_state.resumed_into_validation(ckpt["leto"]["validation_rerun"])
        return ckpt

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
        module = self._lightning_module
        trainer = module._trainer if module is not None else None
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
        """Whether the fit that ends here leaves retained memory someone resumes from.

        Under ``leto launch`` the agent owns it (and frees it when the job ends). Without it, a
        fit that completed leaves nothing to resume, and neither does a single process that
        raised (an exception, ``KeyboardInterrupt``): it is alive and nothing else maps its store.
        With several ranks started by hand, a peer's death reaches this rank as an exception, and
        the caller's recovery (``recover_node``, ``fit(ckpt_path="leto://retained")``) needs every
        store: they are kept, and ``leto cleanup --list`` shows them. A process that died frees
        nothing by itself, as designed. ``keep_retained=True`` keeps it in every case (a caller
        that recovers or inspects it itself frees it: ``release(unlink=True)``, ``leto cleanup``)."""
        if self.runtime is not None or self.keep_retained:
            return True
        if trainer.state.status != TrainerStatus.INTERRUPTED or self.world_size <= 1:
            return False
        log.warning("LetoStrategy: the fit was interrupted; rank %d keeps the retained memory of job %r for a resume "
                    "(fit(ckpt_path=%r)); free it with `leto cleanup --job %s`", self.global_rank, self.job_id,
                    RETAINED_CKPT, self.job_id)
        return True

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
        self.release(unlink=True)

    def release(self, unlink: bool = False) -> None:
        """Drop this process's mappings; ``unlink=True`` also frees the job's retained memory
        (only when no shadow or agent will need it any more)."""
        if self.retained is not None:
            store = self.retained.store
            if unlink:
                store.unlink()
            store.close()
            self.retained = None

    def resolve_fit_ckpt_path(self, ckpt_path: Any, trainer: pl.Trainer | None = None) -> Any:
        """Decide (in the launcher, before Lightning resolves ``ckpt_path``) whether this fit
        continues from retained memory, from a checkpoint file, or starts fresh; returns the
        ckpt_path Lightning should see.

        Under ``leto launch`` a shadow or cold restart continues from retained memory whatever
        ``ckpt_path`` the script passes (a script that always says ``ckpt_path="last"`` works).
        A file ("last", "best", a path) is resolved here exactly as Lightning resolves it, so
        ``configure_ddp`` loads the file Lightning will restore the loops from."""
        if (self._resume_requested() and not self._env_resume_used
                and (ckpt_path is None or self.runtime is not None)):
            self._env_resume_used = True  # a shadow's first fit; later fits start normally
            ckpt_path = RETAINED_CKPT
        from_retained = ckpt_path is not None and str(ckpt_path) == RETAINED_CKPT
        ckpt_file = None
        if ckpt_path is not None and not from_retained and trainer is not None:
            ckpt_path = ckpt_file = trainer._checkpoint_connector._select_ckpt_path(
                TrainerFn.FITTING, ckpt_path, model_provided=True, model_connected=trainer.lightning_module is not None)
        if from_retained:
            self.fit_state.begin(FitMode.SHADOW if self.runtime is not None else FitMode.FROM_RETAINED)
        else:
            self.fit_state.begin(FitMode.FROM_FILE if ckpt_file is not None else FitMode.FRESH, ckpt_file)
        if self.retained is not None and not from_retained:
            self.release(unlink=True)  # a new fit in this process: a fresh store
        return ckpt_path

    def _resume_requested(self) -> bool:
        """Options or ``LETO_RESUME=retained``; under ``leto launch`` also every shadow."""
        if self.runtime is not None and self.runtime.resumes:
            return True
        return self.leto_options.resume_requested()


def _create_store(spec: StoreSpec) -> RetainedStore:
    try:
        return RetainedStore.create(spec)
    except FileExistsError:
        raise RuntimeError(
            f"retained memory of job {spec.job_id!r} rank {spec.rank} already exists: continue from it with "
            f"trainer.fit(ckpt_path={RETAINED_CKPT!r}) (or LETO_RESUME=retained), or free it with "
            f"leto_lightning.retained.shm.unlink_segments({spec.job_id!r}) to start over") from None


LetoStrategy.register_strategies(StrategyRegistry)  # idempotent; see __init__.register
