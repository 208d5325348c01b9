"""What both Leto strategies do at Lightning's hooks, written once: ``LetoFitHooks``.

``LetoStrategy`` (DDP) and ``LetoModelParallelStrategy`` (FSDP2) differ in how they bind the
model to retained memory and how they wrap it; everything around that -- the options, the
agent under ``leto launch``, the resume payload and its in-memory checkpoint, the step
proxy's transaction, the loop-state callback, the training loaders, the recovery metrics and
the fit's end -- is the same, and is this mixin (first in each strategy's bases, over
Lightning's ``ParallelStrategy``). The retained binding, the step protocol and the trainer's
side of the agent protocol are the trainer-side engine's (``runtime/engine.py``), which the
mixin holds (``self.engine``) as plain PyTorch and ``LetoAccelerator`` do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader
from typing_extensions import override

from ...errors import ConfigurationError, UsageError
from ...faults.points import point
from ...retained.config import RetainedConfig
from ...runtime.engine import TrainerEngine, agreed_new_job_id
from ...runtime.link import RuntimeLink
from ...runtime.messages import TrainerPhase
from ...runtime.storage import restore_replaced
from ...updater.retained_optimizer import RetainedOptimizer
from .callback import LetoLoopStateCallback
from .checks import the_optimizer
from .data import ResumableDataLoader
from .environment import LetoEnvironment, under_leto_launch
from .fit_state import FitMode, FitState
from .frozen import FrozenPayload
from .internals import (
    attached_trainer,
    process_group_backend,
    process_group_timeout,
    select_fit_ckpt_path,
    set_launcher,
    set_process_group_backend,
    training_loaders,
)
from .launcher import LetoLauncher, check_launch
from .logs import LogKeeper
from .options import RETAINED_CKPT, LetoRuntimeOptions
from .plateau import restore_monitored
from .proxy import real_optimizer
from .resume import batches_processed, build_checkpoint, capture, set_rng_states
from .versions import check_lightning
from .zero1 import stepped_optimizer

_RETAINED_FIELDS = frozenset(f.name for f in dataclasses.fields(RetainedConfig))
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LetoSettings:
    """A Leto strategy's validated options (the keyword arguments both strategies take)."""

    retained: RetainedConfig
    options: LetoRuntimeOptions
    runtime: RuntimeLink | None


def leto_settings(kwargs: dict[str, Any], retained: RetainedConfig | None, job_id: str | None, resume: str | None,
                  shadow_level: int | str, heartbeat_interval: float, heartbeat_timeout: float) -> LetoSettings:
    """Pop the ``RetainedConfig`` fields out of ``kwargs`` and validate every Leto option; under
    ``leto launch`` the agent owns ranks, store and process-group namespace (``LetoEnvironment``
    goes into ``kwargs`` unless one is given). Refuses an untested Lightning first."""
    check_lightning()  # at Trainer(...): an untested Lightning is refused before anything runs
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _RETAINED_FIELDS}
    if retained is not None and fields:
        raise ConfigurationError(f"pass retained=RetainedConfig(...) or {sorted(fields)}, not both")
    config = retained if retained is not None else RetainedConfig(**fields)
    options = LetoRuntimeOptions(job_id, resume, LetoRuntimeOptions.parse_level(shadow_level),
                                 heartbeat_interval, heartbeat_timeout)
    runtime = RuntimeLink(heartbeat_interval) if under_leto_launch() else None
    if runtime is not None and kwargs.get("cluster_environment") is None:
        kwargs["cluster_environment"] = LetoEnvironment()
    return LetoSettings(config, options, runtime)


class LetoFitHooks(ParallelStrategy):
    """The part of a Leto strategy that does not depend on how the model is wrapped (module doc).

    A strategy sets ``strategy_name`` and ``leto_description``, calls ``_leto_state(settings)``
    after its framework ``__init__``, and supplies the binding: ``_bind_retained`` (which ends
    with ``_bound``), ``_binding_step`` and ``_free_retained``."""

    strategy_name: str
    leto_description: str
    engine: TrainerEngine

    if TYPE_CHECKING:  # what the framework strategy below the mixin defines
        @property
        def num_nodes(self) -> int: ...

        @num_nodes.setter
        def num_nodes(self, num_nodes: int) -> None: ...

        @property
        def num_processes(self) -> int: ...

        def set_world_ranks(self) -> None: ...

    def _leto_state(self, settings: LetoSettings, keep_retained: bool) -> None:
        """Every Leto field, after the framework strategy's ``__init__``."""
        self.retained_config, self.leto_options = settings.retained, settings.options
        self.engine = TrainerEngine(settings.runtime)  # under `leto launch`: with the link to the agent
        self.logs = LogKeeper()
        self.loop_state = LetoLoopStateCallback()
        self.loop_state.attach(self)
        self.keep_retained = keep_retained  # keep the store after any fit (your own recovery): _resume_can_follow
        self.job_id: str | None = None
        self.fit_state = FitState()  # the fit mode and the batch phase (fit_state.py)
        self._proxy: torch.optim.Optimizer | None = None
        self._file_checkpoint: dict | None = None
        self.env_resume_used = False
        self.resume_payload: Any = None
        self.resumed_from: dict | None = None  # build_checkpoint's "leto" entry: what on_train_start restores
        self.train_loaders: weakref.WeakSet[ResumableDataLoader] = weakref.WeakSet()

    @override
    def __getstate__(self) -> dict[str, Any]:
        """A pickled or deep-copied strategy (``torch.save(trainer)``, ``copy.deepcopy``) is a
        detached copy, as a pickled DDP strategy is: no retained memory, step proxy, loaders or
        link to ``leto launch`` travel with it -- those belong to this process's fit -- and its
        next fit decides its mode anew."""
        return dict(super().__getstate__(), engine=TrainerEngine(), _proxy=None, train_loaders=None,
                    fit_state=self.fit_state.detached())

    def __setstate__(self, state: dict[str, Any]) -> None:
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)
        self.train_loaders = weakref.WeakSet()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register this strategy's name once; the inherited method would re-register Lightning's."""
        entry = dict.get(strategy_registry, cls.strategy_name)  # the registry's own get() instantiates
        if entry is None or getattr(entry["strategy"], "leto_factory", False):  # or the package's import-time one
            strategy_registry.register(cls.strategy_name, cls, override=True, description=cls.leto_description)

    # -- what the strategy holds ------------------------------------------------------------------
    @property
    def runtime(self) -> RuntimeLink | None:
        """The link to the agent under ``leto launch`` (the engine's), else None."""
        return self.engine.link

    @property
    def retained(self) -> RetainedOptimizer | None:
        """This rank's retained binding (the engine's), None outside a protected fit."""
        return self.engine.bound

    @property
    def module(self) -> pl.LightningModule:
        """The module of the running fit (Lightning's ``lightning_module``, known to be set)."""
        module = self.lightning_module
        if module is None:
            raise UsageError(f"{type(self).__name__}: no LightningModule is connected (this runs inside trainer.fit())")
        return module

    @property
    def retained_active(self) -> bool:
        return self.engine.bound is not None

    @property
    def committed_any(self) -> bool:
        return self.engine.iteration > 0

    @override
    def _configure_launcher(self) -> None:
        check_launch(self)  # at Trainer(...): Leto never spawns ranks; say how to start them
        set_launcher(self, LetoLauncher(self))

    # -- environment ------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        if self.runtime is not None:
            self.runtime.connect()  # shadows at level 1/2 wait here until promoted
        super().setup_environment()  # accelerator, then the process group
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # before Lightning creates experiments
            self.logs.prepare(trainer, self.runtime, self.global_rank, self.fit_state.mode.continues)

    def _session_group_or(self, lightning_setup: Callable[[], None]) -> None:
        """Under ``leto launch``, not Lightning's ``_init_dist_connection`` (``lightning_setup``):
        the agent already listens on MASTER_PORT, and the group must live under the session's
        generation (or shadow-set) prefix."""
        link = self.runtime
        if link is None:
            lightning_setup()
            return
        set_process_group_backend(self)
        reset_seed()
        self.set_world_ranks()
        backend = process_group_backend(self)
        if not torch.distributed.is_initialized():
            timeout = process_group_timeout(self)
            link.init_process_group(backend, (timeout if timeout is not None else default_pg_timeout).total_seconds())

    def _install_loop_state(self, trainer: pl.Trainer) -> None:
        """The loop-state callback goes last: it sees what the other callbacks did."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if self.loop_state in callbacks:
            callbacks.remove(self.loop_state)
        callbacks.append(self.loop_state)

    # -- binding ----------------------------------------------------------------------------------
    def _begin_binding(self, trainer: pl.Trainer) -> torch.optim.Optimizer:
        """The one optimizer to bind, the fit's mode (a fit the launcher did not see is fresh) and
        the job id (the options', the previous fit's, or a new one every rank agrees on)."""
        optimizer = the_optimizer(self, trainer)
        if self.fit_state.mode is FitMode.NONE:  # a fit the launcher did not see (no resolve_fit_ckpt_path)
            self.fit_state.begin(FitMode.FRESH)
        self.job_id = self.leto_options.resolved_job_id() or self.job_id or agreed_new_job_id(self.world_size)
        return optimizer

    def _prepare_barrier(self) -> Callable[[], None] | None:
        """No chunk of an iteration commits before every rank prepared it (docs/design.md 2.3)."""
        return self.engine.prepare_barrier(self.world_size)

    def _payload_fn(self, trainer: pl.Trainer) -> Callable[[], FrozenPayload]:
        """Pickled once: the prepare and commit records write the same payload."""
        return lambda: FrozenPayload(self.loop_state.payload_at_prepare(trainer))

    # -- the step ---------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        ro = self.retained
        if ro is None or real_optimizer(optimizer) is not stepped_optimizer(ro):
            raise UsageError(f"{type(self).__name__}: this optimizer is not bound to retained memory (created "
                             "outside configure_optimizers?); it would train without protection")
        assert self._proxy is not None  # made with the binding
        return super().optimizer_step(self._proxy, closure, model, **kwargs)

    def _retained_step(self, closure: Callable | None) -> Any:
        """The proxy's ``step``: closure (forward, backward, clipping), then the transactions."""
        loss = self.engine.step(closure, self._binding_step)
        self.fit_state.step_committed()
        return loss

    def _binding_step(self, closure: Callable | None) -> Any:
        raise NotImplementedError  # the strategy's binding: its step

    def record_payload(self, payload: Any) -> None:
        """Replace the resume payload of the last committed iteration (same iteration, newer
        payload; the record's two slots keep the previous one until this write is complete).
        Manual optimization keeps it to write again (as "before"); there the record also seals
        the batch's update (kept from here on)."""
        ro = self.retained
        assert ro is not None
        ro.record_committed(FrozenPayload(payload))

    # -- hooks ------------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        """Monitored values, RNG, logs, the "start" payload, and the agent told the loop is restored."""
        resumed, self.resumed_from = self.resumed_from or {}, None
        self._on_resumed(resumed.get("kind"))
        trainer = self.module.trainer
        restore_monitored(trainer, resumed.get("monitored") or {})
        if resumed.get("rng") is not None:
            set_rng_states(resumed["rng"])  # last thing before the first batch: as the crashed run
        # before "start": a fresh run's payload counts no rows yet
        self.logs.on_train_start(trainer, self.retained.iteration if self.retained is not None else None)
        if self.fit_state.mode is FitMode.FROM_FILE:
            say_mid_epoch_resume(type(self).__name__, trainer, resumed.get("kind") is not None)
        if self.retained is not None and self.retained.iteration == 0:
            self.record_payload(capture(trainer, "start"))
        self.engine.resumed()  # loop, RNG and data position are restored

    def _on_resumed(self, kind: str | None) -> None:
        """The strategy's own part of ``on_train_start`` (``kind``: the resumed payload's, or None)."""

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.fit_state.batch_started()
        trainer = self.module.trainer
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        for loader in list(self.train_loaders):
            loader.mark(batch_idx + 1, last)
        if self.runtime is not None and self.retained is not None:
            self.logs.log_recoveries(trainer)
        self.engine.batch_start()

    @override
    def on_train_end(self) -> None:
        if self.runtime is not None:
            self.logs.finish(self.module.trainer)
        self.engine.finished()  # a crash during interpreter exit is no failure

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.engine.report_exception(exception)
        super().on_exception(exception)

    def fault_point(self, name: str, phase: str) -> None:
        """A named point between steps (validation, epoch end, after a checkpoint save): a
        heartbeat at most every interval, and where tests inject faults under ``leto launch``."""
        self.engine.alive(TrainerPhase(phase))
        point(name)

    def _checkpoint_saved(self, checkpoint: dict[str, Any]) -> None:
        if self.runtime is not None and self.is_global_zero:
            self.logs.checkpoint_saved(self.runtime, int(checkpoint.get("global_step", 0)))
        self.fault_point("lightning.after_checkpoint", "checkpoint")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader becomes a ``ResumableDataLoader`` (other loaders stay as they are)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = attached_trainer(self.lightning_module)
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        wrapped = ResumableDataLoader(dataloader, _processed_counter(trainer))
        if wrapped.unreplayable_order():
            rank_zero_warn(f"{type(self).__name__}: the training DataLoader shuffles with an unseeded RandomSampler; "
                           "a resume mid-epoch cannot replay its order. Pass DataLoader(generator=...) or keep "
                           "use_distributed_sampler=True.")
        self.train_loaders.add(wrapped)
        return wrapped

    # -- resume -----------------------------------------------------------------------------------
    def _payload_checkpoint(self) -> dict[str, Any]:
        """The in-memory checkpoint of the resume payload (from retained memory or a checkpoint
        file); what Lightning's restore does not cover is kept for ``on_train_start``."""
        ckpt = build_checkpoint(self.module.trainer, self.resume_payload)
        self.resumed_from = ckpt["leto"]
        self.fit_state.resumed_into_validation(ckpt["leto"]["validation_rerun"])
        return ckpt

    def _retained_checkpoint(self) -> dict[str, Any]:
        """``load_checkpoint("leto://retained")``: only in a fit that continues from retained memory."""
        if not self.fit_state.mode.from_retained_memory or self.retained is None:
            raise UsageError(f"ckpt_path={RETAINED_CKPT!r} resumes training from retained memory: use it with "
                             f"trainer.fit() on a Trainer with {type(self).__name__}")
        return self._payload_checkpoint()

    def _retained_ckpt_path(self, ckpt_path: Any) -> Any:
        """``ckpt_path`` with ``leto://retained`` for a fit that continues from retained memory:
        asked for by the options or ``LETO_RESUME=retained``; under ``leto launch`` a shadow or
        cold restart whatever the script passes (a script that always says ``ckpt_path="last"``
        works)."""
        requested = self.engine.continues(self.leto_options.resume_requested())
        if requested and not self.env_resume_used and (ckpt_path is None or self.runtime is not None):
            self.env_resume_used = True  # a shadow's first fit; later fits start normally
            return RETAINED_CKPT
        return ckpt_path

    def resolve_fit_ckpt_path(self, ckpt_path: Any, trainer: pl.Trainer | None = None) -> Any:
        """Decide (in the launcher, before Lightning resolves ``ckpt_path``) whether this fit
        continues from retained memory, from a checkpoint file, or starts fresh; returns the
        ckpt_path Lightning should see. A file ("last", "best", a path) is resolved here exactly
        as Lightning resolves it, so the strategy loads the file Lightning will restore the loops
        from (a distributed checkpoint under FSDP2)."""
        ckpt_path = self._retained_ckpt_path(ckpt_path)
        from_retained = ckpt_path is not None and str(ckpt_path) == RETAINED_CKPT
        ckpt_file = None
        if ckpt_path is not None and not from_retained and trainer is not None:
            for callback in trainer.checkpoint_callbacks:  # a save a crash cut between its two renames
                restore_replaced(getattr(callback, "dirpath", None) or "")
            ckpt_path = ckpt_file = select_fit_ckpt_path(trainer, ckpt_path)
        if from_retained:
            self.fit_state.begin(FitMode.SHADOW if self.runtime is not None else FitMode.FROM_RETAINED)
        else:
            self.fit_state.begin(FitMode.FROM_FILE if ckpt_file is not None else FitMode.FRESH, ckpt_file)
        if self.retained is not None and not from_retained:
            self.release(unlink=True)  # a new fit in this process: a fresh store
        return ckpt_path

    # -- the end of a fit -------------------------------------------------------------------------
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

    def _free_retained(self) -> None:
        """The fit ended and nothing resumes from its retained memory: free it (the strategy
        copies what the model and optimizer must keep out first)."""
        self.release(unlink=True)

    def release(self, unlink: bool = False) -> None:
        """Drop this process's mappings; ``unlink=True`` also frees the job's retained memory
        (only when no shadow or agent will need it any more)."""
        self.engine.release(unlink)

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
        log.warning("%s: the fit was interrupted; rank %d keeps the retained memory of job %r for a resume "
                    "(fit(ckpt_path=%r)); free it with `leto cleanup --job %s`", type(self).__name__, self.global_rank,
                    self.job_id, RETAINED_CKPT, self.job_id)
        return True


MID_EPOCH = "resuming from a checkpoint that ended before the epoch ended"  # Lightning's words


def say_mid_epoch_resume(who: str, trainer: pl.Trainer, with_payload: bool) -> None:
    """``fit(ckpt_path=<file>)`` from a file saved mid-epoch: say what the resume does.

    Lightning warns ("You're resuming from a checkpoint that ended before the epoch ended ...")
    only when a training loader is not resumable; a Leto strategy's always are
    (``ResumableDataLoader``), so Lightning stays silent, and this says it instead: exact with
    the file's Leto payload; the right batches but not the random state without one; and
    Lightning's unreliable case when the file holds no loader position at all (not written by
    a Leto fit). Lightning's condition, measured on 2.6.6 (``_TrainingEpochLoop.reset``)."""
    loop, batches = trainer.fit_loop.epoch_loop, trainer.num_training_batches
    if not loop.restarting or batches == float("inf"):
        return
    if trainer.global_step % math.ceil(batches / trainer.accumulate_grad_batches) == 0:
        return
    loaders = training_loaders(trainer)
    if not loaders or not all(isinstance(x, ResumableDataLoader) for x in loaders):
        return  # Lightning warns itself about a loader that is not resumable
    where = f"{who} is {MID_EPOCH} (global step {trainer.global_step})"
    if with_payload:
        rank_zero_info(f"{where}: it continues exactly, at the next batch of the epoch and with the interrupted "
                       "run's random state (the file carries a Leto resume payload).")
    elif all(x.restored for x in loaders):
        rank_zero_warn(f"{where}: the training DataLoader continues at the next batch of the epoch (the file "
                       "holds its position), but the file carries no Leto resume payload (it was saved outside a "
                       "Leto fit's batch ends and validation ends: inside a batch, or after fit() ended), so the "
                       "random state (dropout, augmentation) is not the interrupted run's.",
                       category=PossibleUserWarning)
    else:
        rank_zero_warn(f"{where}, and the file holds no position of the training DataLoader (it was not written "
                       "by a Leto fit): the epoch's batches start again from its first batch while the loop "
                       "continues mid-epoch, which can cause unreliable results, as Lightning warns for a loader "
                       "that is not resumable. Consider an end-of-epoch checkpoint.", category=PossibleUserWarning)


def _processed_counter(trainer: pl.Trainer) -> Callable[[], int | None]:
    """``resume.batches_processed`` of ``trainer``, held weakly (the loader lives in the trainer)."""
    ref = weakref.ref(trainer)

    def processed() -> int | None:
        live = ref()
        return None if live is None else batches_processed(live)

    return processed


def file_payload(checkpoint: dict[str, Any]) -> Any:
    """The Leto resume payload a checkpoint file carries (``LetoLoopStateCallback``), or None."""
    return (checkpoint.get("callbacks", {}).get("LetoLoopStateCallback") or {}).get("payload")
