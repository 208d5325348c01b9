"""What both Leto strategies do at Lightning's hooks, written once.

``LetoStrategy`` (DDP) and ``LetoModelParallelStrategy`` (FSDP2) differ in how they bind the
model to retained memory and how they wrap it; everything around that -- the options, the
session under ``leto launch``, the resume payload and its in-memory checkpoint, the step
proxy's transaction, the loop-state callback, the training loaders, the recovery metrics and
the fit's end -- is the same. Those parts are the functions here, each taking the strategy
(``LetoHost``: the attributes both define) and called from a one-line ``@override`` in each.
Functions, not a mixin: the state stays the strategy's own, typed by the protocol.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader

from ...env import job_prefix
from ...errors import UsageError
from ...faults.points import point
from ...retained.config import RetainedConfig
from ...retained.shm import new_job_id
from ...retained.torch_internals import mark_optimizer_stepped
from ...runtime.link import RuntimeLink
from ...runtime.storage import restore_replaced
from ...updater.retained_optimizer import RetainedOptimizer
from .callback import LetoLoopStateCallback
from .data import ResumableDataLoader
from .environment import LetoEnvironment, under_leto_launch
from .fit_state import FitMode, FitState
from .frozen import FrozenPayload
from .internals import (
    attached_trainer,
    process_group_backend,
    process_group_timeout,
    select_fit_ckpt_path,
    training_loaders,
)
from .logs import LogKeeper
from .options import RETAINED_CKPT, LetoRuntimeOptions
from .plateau import restore_monitored
from .resume import batches_processed, build_checkpoint, capture, set_rng_states

_RETAINED_FIELDS = frozenset(f.name for f in dataclasses.fields(RetainedConfig))
log = logging.getLogger(__name__)


class LetoHost(Protocol):
    """What the shared hooks need of a Leto strategy (both strategies define these)."""

    retained_config: RetainedConfig
    leto_options: LetoRuntimeOptions
    runtime: RuntimeLink | None
    logs: LogKeeper
    loop_state: LetoLoopStateCallback
    retained: RetainedOptimizer | None
    keep_retained: bool
    job_id: str | None
    fit_state: FitState
    resume_payload: Any
    resumed_from: dict | None
    env_resume_used: bool
    train_loaders: weakref.WeakSet[ResumableDataLoader]

    @property
    def module(self) -> pl.LightningModule: ...

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def set_world_ranks(self) -> None: ...

    def release(self, unlink: bool = False) -> None: ...


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
    goes into ``kwargs`` unless one is given)."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _RETAINED_FIELDS}
    if retained is not None and fields:
        raise ValueError(f"pass retained=RetainedConfig(...) or {sorted(fields)}, not both")
    config = retained if retained is not None else RetainedConfig(**fields)
    options = LetoRuntimeOptions(job_id, resume, LetoRuntimeOptions.parse_level(shadow_level),
                                 heartbeat_interval, heartbeat_timeout)
    runtime = RuntimeLink(heartbeat_interval) if under_leto_launch() else None
    if runtime is not None and kwargs.get("cluster_environment") is None:
        kwargs["cluster_environment"] = LetoEnvironment()
    return LetoSettings(config, options, runtime)


# -- environment ---------------------------------------------------------------------------
def prepare_logs(host: LetoHost) -> None:
    """At ``setup_environment``, before Lightning creates experiments: continue the loggers."""
    trainer = attached_trainer(host.lightning_module)
    if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
        host.logs.prepare(trainer, host.runtime, host.global_rank, host.fit_state.mode.continues)


def init_session_group(host: LetoHost, link: RuntimeLink) -> None:
    """Not Lightning's _init_dist_connection: the agent already listens on MASTER_PORT, and the
    group must live under the session's generation (or shadow-set) prefix."""
    reset_seed()
    host.set_world_ranks()
    backend = process_group_backend(host)
    if not torch.distributed.is_initialized():
        timeout = process_group_timeout(host)
        timeout = timeout if timeout is not None else default_pg_timeout
        link.init_process_group(backend, timeout.total_seconds())


def install_loop_state(host: LetoHost, trainer: pl.Trainer) -> None:
    """The loop-state callback goes last: it sees what the other callbacks did."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    if host.loop_state in callbacks:
        callbacks.remove(host.loop_state)
    callbacks.append(host.loop_state)


# -- binding helpers -----------------------------------------------------------------------
def agreed_new_job_id(host: LetoHost) -> str:
    """A fresh job id, the same on every rank (rank 0's): tier 2 attaches the peers' stores."""
    job = new_job_id(job_prefix())
    if host.world_size > 1 and torch.distributed.is_initialized():
        job = host.broadcast(job, src=0)
    return job


def prepare_barrier(host: LetoHost) -> Callable[[], None] | None:
    """No chunk of an iteration commits before every rank prepared it (docs/design.md 2.3)."""
    if host.runtime is not None:
        return host.runtime.barrier  # the session's flag all-reduce
    if host.world_size <= 1:
        return None
    return lambda: torch.distributed.barrier()


def payload_fn(host: LetoHost, trainer: pl.Trainer) -> Callable[[], FrozenPayload]:
    """Pickled once: the prepare and commit records write the same payload."""
    return lambda: FrozenPayload(host.loop_state.payload_at_prepare(trainer))


# -- the step ------------------------------------------------------------------------------
def retained_step(host: LetoHost, closure: Callable | None, step: Callable[[Callable | None], Any]) -> Any:
    """The proxy's ``step``: closure (forward, backward, clipping), then ``step`` (the
    transactions); the agent hears "update" in between."""
    ro = host.retained
    assert ro is not None
    link = host.runtime
    if link is not None and closure is not None:
        inner = closure

        def closure() -> Any:  # forward and backward, then the agent hears "update"
            out = inner()
            link.update_start(ro.iteration)
            return out
    elif link is not None:  # 16-mixed: the precision plugin ran the closure before the scaler's step
        link.update_start(ro.iteration)
    loss = step(closure)
    mark_optimizer_stepped(ro.optimizer)  # what the LR scheduler's step wrapper sets
    host.fit_state.step_committed()
    if link is not None:
        link.step_done(ro.iteration - 1)
    return loss


def record_payload(host: LetoHost, payload: Any) -> None:
    """Replace the resume payload of the last committed iteration (same iteration, newer
    payload; the record's two slots keep the previous one until this write is complete)."""
    ro = host.retained
    assert ro is not None
    # Manual optimization keeps it to write again (as "before"); there the record also seals
    # the batch's update (kept from here on).
    ro.record_committed(FrozenPayload(payload))


# -- hooks ---------------------------------------------------------------------------------
def train_start(host: LetoHost, resumed: dict) -> None:
    """``on_train_start`` after the strategy's own part: monitored values, RNG, logs, the
    "start" payload, and the agent told the loop is restored."""
    trainer = host.module.trainer
    restore_monitored(trainer, resumed.get("monitored") or {})
    if resumed.get("rng") is not None:
        set_rng_states(resumed["rng"])  # last thing before the first batch: as the crashed run
    # before "start": a fresh run's payload counts no rows yet
    host.logs.on_train_start(trainer, host.retained.iteration if host.retained is not None else None)
    if host.fit_state.mode is FitMode.FROM_FILE:
        say_mid_epoch_resume(host, trainer, resumed.get("kind") is not None)
    if host.retained is not None and host.retained.iteration == 0:
        record_payload(host, capture(trainer, "start"))
    if host.runtime is not None and host.runtime.resume_pending and host.retained is not None:
        host.runtime.resumed(host.retained.iteration)  # loop, RNG and data position are restored


MID_EPOCH = "resuming from a checkpoint that ended before the epoch ended"  # Lightning's words


def say_mid_epoch_resume(host: LetoHost, trainer: pl.Trainer, with_payload: bool) -> None:
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
    where = f"{type(host).__name__} is {MID_EPOCH} (global step {trainer.global_step})"
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


def train_batch_start(host: LetoHost, batch_idx: int) -> None:
    host.fit_state.batch_started()
    trainer = host.module.trainer
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    for loader in list(host.train_loaders):
        loader.mark(batch_idx + 1, last)
    if host.runtime is not None and host.retained is not None:
        host.logs.log_recoveries(trainer)
        host.runtime.batch_start(host.retained.iteration)


def train_end(host: LetoHost) -> None:
    if host.runtime is not None:
        host.logs.finish(host.module.trainer)
        if host.runtime.session is not None:
            host.runtime.session.mark_finished()  # a crash during interpreter exit is no failure


def fault_point(host: LetoHost, name: str, phase: str) -> None:
    """A named point between steps (validation, epoch end, after a checkpoint save): a
    heartbeat at most every interval, and where tests inject faults under ``leto launch``."""
    if host.runtime is not None and host.retained is not None:
        host.runtime.alive(host.retained.iteration - 1, phase)
    point(name)


def checkpoint_saved(host: LetoHost, checkpoint: dict[str, Any], is_global_zero: bool) -> None:
    if host.runtime is not None and is_global_zero:
        host.logs.checkpoint_saved(host.runtime, int(checkpoint.get("global_step", 0)))
    fault_point(host, "lightning.after_checkpoint", "checkpoint")


def wrap_train_loader(host: LetoHost, dataloader: object) -> object:
    """The training loader becomes a ``ResumableDataLoader`` (other loaders stay as they are)."""
    trainer = attached_trainer(host.lightning_module)
    if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
        return dataloader
    wrapped = ResumableDataLoader(dataloader, _processed_counter(trainer))
    if wrapped.unreplayable_order():
        rank_zero_warn(f"{type(host).__name__}: the training DataLoader shuffles with an unseeded RandomSampler; a "
                       "resume mid-epoch cannot replay its order. Pass DataLoader(generator=...) or keep "
                       "use_distributed_sampler=True.")
    host.train_loaders.add(wrapped)
    return wrapped


def _processed_counter(trainer: pl.Trainer) -> Callable[[], int | None]:
    """``resume.batches_processed`` of ``trainer``, held weakly (the loader lives in the trainer)."""
    ref = weakref.ref(trainer)

    def processed() -> int | None:
        live = ref()
        return None if live is None else batches_processed(live)

    return processed


# -- resume --------------------------------------------------------------------------------
def payload_checkpoint(host: LetoHost) -> dict[str, Any]:
    """The in-memory checkpoint of the resume payload (from retained memory or a checkpoint
    file); what Lightning's restore does not cover is kept for ``on_train_start``."""
    ckpt = build_checkpoint(host.module.trainer, host.resume_payload)
    host.resumed_from = ckpt["leto"]
    host.fit_state.resumed_into_validation(ckpt["leto"]["validation_rerun"])
    return ckpt


def check_retained_resume(host: LetoHost) -> None:
    if not host.fit_state.mode.from_retained_memory or host.retained is None:
        raise UsageError(f"ckpt_path={RETAINED_CKPT!r} resumes training from retained memory: use it with "
                         f"trainer.fit() on a Trainer with {type(host).__name__}")


def resume_requested(host: LetoHost) -> bool:
    """Options or ``LETO_RESUME=retained``; under ``leto launch`` also every shadow."""
    if host.runtime is not None and host.runtime.resumes:
        return True
    return host.leto_options.resume_requested()


def retained_ckpt_path(host: LetoHost, ckpt_path: Any) -> Any:
    """``ckpt_path`` with ``leto://retained`` for a fit that continues from retained memory:
    under ``leto launch`` a shadow or cold restart whatever the script passes (a script that
    always says ``ckpt_path="last"`` works)."""
    if (resume_requested(host) and not host.env_resume_used
            and (ckpt_path is None or host.runtime is not None)):
        host.env_resume_used = True  # a shadow's first fit; later fits start normally
        return RETAINED_CKPT
    return ckpt_path


def begin_fit(host: LetoHost, ckpt_path: Any, trainer: pl.Trainer | None) -> Any:
    """Decide (in the launcher, before Lightning resolves ``ckpt_path``) whether this fit
    continues from retained memory, from a checkpoint file, or starts fresh; returns the
    ckpt_path Lightning should see. A file ("last", "best", a path) is resolved here exactly as
    Lightning resolves it, so the strategy loads the file Lightning will restore the loops from."""
    ckpt_path = retained_ckpt_path(host, ckpt_path)
    from_retained = ckpt_path is not None and str(ckpt_path) == RETAINED_CKPT
    ckpt_file = None
    if ckpt_path is not None and not from_retained and trainer is not None:
        for callback in trainer.checkpoint_callbacks:  # a save a crash cut between its two renames
            restore_replaced(getattr(callback, "dirpath", None) or "")
        ckpt_path = ckpt_file = select_fit_ckpt_path(trainer, ckpt_path)
    if from_retained:
        host.fit_state.begin(FitMode.SHADOW if host.runtime is not None else FitMode.FROM_RETAINED)
    else:
        host.fit_state.begin(FitMode.FROM_FILE if ckpt_file is not None else FitMode.FRESH, ckpt_file)
    if host.retained is not None and not from_retained:
        host.release(unlink=True)  # a new fit in this process: a fresh store
    return ckpt_path


def file_payload(checkpoint: dict[str, Any]) -> Any:
    """The Leto resume payload a checkpoint file carries (``LetoLoopStateCallback``), or None."""
    return (checkpoint.get("callbacks", {}).get("LetoLoopStateCallback") or {}).get("payload")


# -- the end of a fit ----------------------------------------------------------------------
def resume_can_follow(host: LetoHost, trainer: pl.Trainer) -> bool:
    """Whether the fit that ends here leaves retained memory someone resumes from.

    Under ``leto launch`` the agent owns it (and frees it when the job ends). Without it, a
    fit that completed leaves nothing to resume, and neither does a single process that
    raised (an exception, ``KeyboardInterrupt``): it is alive and nothing else maps its store.
    With several ranks started by hand, a peer's death reaches this rank as an exception, and
    the caller's recovery (``recover_node``, ``fit(ckpt_path="leto://retained")``) needs every
    store: they are kept, and ``leto cleanup --list`` shows them. A process that died frees
    nothing by itself, as designed. ``keep_retained=True`` keeps it in every case (a caller
    that recovers or inspects it itself frees it: ``release(unlink=True)``, ``leto cleanup``)."""
    if host.runtime is not None or host.keep_retained:
        return True
    if trainer.state.status != TrainerStatus.INTERRUPTED or host.world_size <= 1:
        return False
    log.warning("%s: the fit was interrupted; rank %d keeps the retained memory of job %r for a resume "
                "(fit(ckpt_path=%r)); free it with `leto cleanup --job %s`", type(host).__name__, host.global_rank,
                host.job_id, RETAINED_CKPT, host.job_id)
    return True


def release(host: LetoHost, unlink: bool = False) -> None:
    """Drop this process's mappings; ``unlink=True`` also frees the job's retained memory
    (only when no shadow or agent will need it any more)."""
    if host.retained is not None:
        store = host.retained.store
        host.retained.drop_hooks()  # else the parameters' hooks keep the store mapped while they live
        if unlink:
            store.unlink()
        store.close()
        host.retained = None
