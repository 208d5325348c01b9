"""Every private Lightning attribute Leto touches, and its one patch of a Lightning class.

Why a module of its own: Lightning changes its private names between releases without notice
(``versions.py`` refuses untested releases for that reason). Each use is a small named function
here that says why Leto needs it; the other integration modules call these and touch nothing
private themselves. ``PRIVATE_ATTRIBUTES`` lists every private name used (the owner's import
path -> the names), ``PATCHES`` every framework attribute replaced;
``tests/test_framework_internals.py`` checks them all against the installed Lightning (an
upgrade that removes one fails there, naming it) and refuses private framework accesses
anywhere else in the package.

Imports only Lightning (and no module of this package): ``launch_guard.install`` runs right after
``lightning.pytorch`` executed, possibly in the middle of importing another module of this package.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


# -- the patch ---------------------------------------------------------------------------------
# Defined before this module imports Lightning: importing Lightning runs the strategy
# registration hook (``_autoregister``), which under ``leto launch`` calls
# ``launch_guard.install()`` and so this function -- possibly while this very module is being
# imported, when it is the first to import Lightning.
def replace_trainer_init(wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> bool:
    """Replace ``Trainer.__init__`` by ``wrap(original)``, once per process (False when already
    done). Lightning has no hook that sees every strategy choice (``launch_guard.py``)."""
    import lightning.pytorch as pl

    init = pl.Trainer.__init__
    if getattr(init, "leto_guard", False):
        return False
    guarded = functools.wraps(init)(wrap(init))
    guarded.leto_guard = True  # type: ignore[attr-defined]
    pl.Trainer.__init__ = guarded  # type: ignore[method-assign]
    return True


import lightning.pytorch as pl  # noqa: E402  (after replace_trainer_init: see there)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed  # noqa: E402
from lightning.pytorch.core.optimizer import _MockOptimizer  # noqa: E402
from lightning.pytorch.loggers.csv_logs import ExperimentWriter  # noqa: E402
from lightning.pytorch.loops.loop import _Loop  # noqa: E402
from lightning.pytorch.loops.progress import _BaseProgress  # noqa: E402
from lightning.pytorch.strategies.launchers.launcher import _Launcher  # noqa: E402
from lightning.pytorch.trainer import call  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

# import path of the owner (a module or class) -> the private names used on it or its instances
PRIVATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.core.module.LightningModule": ("_trainer",),
    "lightning.pytorch.core.optimizer": ("_MockOptimizer",),
    "lightning.pytorch.strategies.launchers.launcher": ("_Launcher",),
    "lightning.fabric.utilities.distributed": ("_set_num_threads_if_needed",),
    # _configure_launcher and _setup_distributed: overridden by Leto's strategies
    "lightning.pytorch.strategies.ddp.DDPStrategy": (
        "_configure_launcher", "_launcher", "_get_process_group_backend", "_process_group_backend", "_timeout",
        "_ddp_kwargs"),
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy": (
        "_configure_launcher", "_setup_distributed", "_launcher", "_get_process_group_backend",
        "_process_group_backend", "_timeout", "_data_parallel_size", "_save_distributed_checkpoint"),
    "lightning.pytorch.trainer.trainer.Trainer": (
        "_fit_impl", "_logger_connector", "_results", "_checkpoint_connector"),
    "lightning.pytorch.trainer.connectors.logger_connector.logger_connector._LoggerConnector": (
        "_first_loop_iter", "_callback_metrics"),
    "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector": ("_select_ckpt_path",),
    "lightning.pytorch.trainer.call": (
        "_call_callbacks_state_dict", "_call_callbacks_on_load_checkpoint", "_call_callbacks_load_state_dict"),
    "lightning.pytorch.loops.loop": ("_Loop",),
    "lightning.pytorch.loops.progress": ("_BaseProgress",),
    "lightning.pytorch.loops.fit_loop._FitLoop": ("_should_accumulate", "_restarting", "_combined_loader",
                                                  "_data_fetcher"),
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop": (
        "_batches_that_stepped", "_num_ready_batches_reached", "_should_check_val_fx"),
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint": ("_last_global_step_saved",),
    "lightning.pytorch.loggers.csv_logs.CSVLogger": ("_version", "_experiment"),
    "lightning.pytorch.loggers.csv_logs.ExperimentWriter": ("_check_log_dir_exists",),
    "lightning.pytorch.loggers.tensorboard.TensorBoardLogger": ("_version", "_experiment", "_kwargs"),
    "lightning.pytorch.loggers.wandb.WandbLogger": ("_experiment", "_wandb_init"),
    # what torch.utils.tensorboard.SummaryWriter writes with (TensorBoardLogger's experiment)
    "tensorboard.summary.writer.event_file_writer.EventFileWriter": ("_file_name",),
}

# framework attribute replaced -> why (``replace_trainer_init``)
PATCHES: dict[str, str] = {
    "lightning.pytorch.trainer.trainer.Trainer.__init__":
        "under `leto launch` a Trainer without a Leto strategy fails at construction, naming it (launch_guard.py)",
}

# Private base classes and types Leto builds on, under public names.
Launcher = _Launcher  # LetoLauncher implements Lightning's launcher interface (launcher.py)
Loop = _Loop  # the fast loop state_dict walks Lightning's loops (loop_state.py)
BaseProgress = _BaseProgress


# -- strategies --------------------------------------------------------------------------------
def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or None (the public ``module.trainer`` raises
    then): hooks that also run outside a fit (teardown, ``process_dataloader``) must tell."""
    return module._trainer if module is not None else None


def set_launcher(strategy: Any, launcher: Any) -> None:
    """Install Leto's launcher (from the overridden ``_configure_launcher``): Lightning's own
    spawns ranks and kills them all when one dies, which Leto recovers from in place."""
    strategy._launcher = launcher


def set_process_group_backend(strategy: Any) -> None:
    """Resolve the backend as ``setup_distributed`` does before Leto builds the process group
    itself, in the session's namespace (``fit_hooks.init_session_group``)."""
    strategy._process_group_backend = strategy._get_process_group_backend()


def process_group_backend(strategy: Any) -> str:
    """The backend Lightning would start its process group with."""
    backend: str = strategy._get_process_group_backend()
    return backend


def process_group_timeout(strategy: Any) -> Any:
    """The ``timeout`` given to the strategy (None: Lightning's default)."""
    return strategy._timeout


@contextmanager
def ddp_init_sync_off(strategy: Any) -> Iterator[None]:
    """While the DDP wrapper is built: no initial broadcast from rank 0. A shadow is built while
    the active trainers still write the memory it views; after promotion every rank's retained
    parameters are the same committed values. ``DDPStrategy`` keeps its wrapper's keyword
    arguments privately."""
    kwargs = strategy._ddp_kwargs
    kwargs["init_sync"] = False
    try:
        yield
    finally:
        kwargs.pop("init_sync", None)


def shard_every_rank(strategy: Any) -> None:
    """``ModelParallelStrategy(data_parallel_size="auto")`` resolved so every rank shards (Leto
    retains data-parallel shards only), before Lightning builds the device mesh."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether ``ModelParallelStrategy`` writes a distributed checkpoint directory (which Leto
    stages and puts in place whole) rather than one file."""
    return bool(strategy._save_distributed_checkpoint)


def is_fit_impl(function: Callable[..., Any]) -> bool:
    """Whether the launcher is asked to run ``Trainer._fit_impl``: Leto resolves its
    ``ckpt_path`` first (from retained memory, a file, or fresh)."""
    return getattr(function, "__name__", "") == "_fit_impl"


def set_num_threads_if_needed(num_processes: int) -> None:
    """What the ``"ddp"`` launcher does in every process: with ``OMP_NUM_THREADS`` unset,
    CPUs // processes intra-op threads (another count changes CPU kernels' reduction order)."""
    _set_num_threads_if_needed(num_processes=num_processes)


def is_mock_optimizer(optimizer: Any) -> bool:
    """``configure_optimizers()`` returned None: Lightning stands in a mock optimizer."""
    return isinstance(optimizer, _MockOptimizer)


def select_fit_ckpt_path(trainer: pl.Trainer, ckpt_path: Any) -> Any:
    """The checkpoint ``fit(ckpt_path=...)`` will restore ("last", "best", a path), resolved
    exactly as Lightning resolves it, so the strategy loads the same file before binding."""
    return trainer._checkpoint_connector._select_ckpt_path(
        TrainerFn.FITTING, ckpt_path, model_provided=True, model_connected=trainer.lightning_module is not None)


# -- the fit loop ------------------------------------------------------------------------------
def should_accumulate(trainer: pl.Trainer) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step after it): payloads
    and plateau steps are due at stepping batch ends only."""
    return bool(trainer.fit_loop._should_accumulate())


def num_ready_batches_reached(trainer: pl.Trainer) -> bool:
    """Whether this batch is the epoch's last: epoch-interval schedulers step after it."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Lightning's logging step (the batches that stepped the optimizer)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def validation_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs validation after this training batch (the epoch loop decides
    from its private data fetcher)."""
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher))


def fit_loop_restarting(trainer: pl.Trainer) -> bool:
    """Whether the fit loop restarts from a checkpoint (Lightning then skips epoch-end
    plateau steps that a resumed Leto fit must take)."""
    return bool(trainer.fit_loop._restarting)


def set_fit_loop_restarting(trainer: pl.Trainer, value: bool) -> None:
    trainer.fit_loop._restarting = value


def training_loaders(trainer: pl.Trainer) -> list[Any]:
    """The fit loop's training loaders (after ``process_dataloader``), or [] before it has any."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


# -- callbacks and metrics -----------------------------------------------------------------------
def callbacks_state_dict(trainer: pl.Trainer) -> dict[str, Any]:
    """Every callback's ``state_dict()``, keyed as Lightning keys them in a checkpoint: the
    resume payload carries them."""
    states: dict[str, Any] = call._call_callbacks_state_dict(trainer)
    return states


def restore_callbacks(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """What Lightning's ``restore_callbacks`` does with a loaded checkpoint: every callback's
    ``on_load_checkpoint``, then its ``load_state_dict`` with its saved state."""
    call._call_callbacks_on_load_checkpoint(trainer, checkpoint)
    call._call_callbacks_load_state_dict(trainer, checkpoint)


def step_metrics_due(trainer: pl.Trainer) -> dict[str, Any] | None:
    """What the logger connector's ``update_train_step_metrics`` will log after this batch (None:
    nothing): a payload carries it, since a committed batch is not recomputed after a crash."""
    connector = trainer._logger_connector
    fast_dev_run = trainer.fast_dev_run  # type: ignore[attr-defined]  # set by Lightning's init
    if trainer.fit_loop._should_accumulate() or not (connector.should_update_logs or fast_dev_run):
        return None
    if trainer._results is None or connector._first_loop_iter is None:
        return None
    metrics: dict[str, Any] = connector.metrics["log"]
    return metrics


def log_metrics(trainer: pl.Trainer, metrics: dict[str, Any], step: int) -> None:
    """Log through Lightning's logger connector (every logger, its step bookkeeping): the step
    metrics a crashed predecessor never logged."""
    trainer._logger_connector.log_metrics(metrics, step=step)


def restore_callback_metrics(trainer: pl.Trainer, values: dict[str, Any]) -> None:
    """Put monitored metrics back into ``callback_metrics`` (read-only in public)."""
    trainer._logger_connector._callback_metrics.update(values)


def last_global_step_saved(callback: Any) -> int:
    """The global step of a checkpoint callback's newest save (``ModelCheckpoint``; 0 for others)."""
    return int(getattr(callback, "_last_global_step_saved", 0))


# -- loggers -------------------------------------------------------------------------------------
def version_unset(logger: Any) -> bool:
    """A ``CSVLogger``/``TensorBoardLogger`` whose version was not given and not yet resolved
    (it would pick the next free ``version_N``): Leto gives it the job's version."""
    return getattr(logger, "_version", "") is None


def set_version(logger: Any, version: int | str) -> None:
    logger._version = version


def experiment_or_none(logger: Any) -> Any:
    """The logger's experiment if created, else None (the public property creates it)."""
    return logger._experiment


def set_experiment(logger: Any, experiment: Any) -> None:
    """Give a logger its experiment (a CSV writer that keeps the file), or None to have the next
    access create a new one."""
    logger._experiment = experiment


def wandb_init_kwargs(logger: Any) -> dict[str, Any]:
    """``WandbLogger``'s ``wandb.init`` arguments (the dict itself): Leto adds the job's group
    before the run is created."""
    init: dict[str, Any] = logger._wandb_init
    return init


def csv_writer_keeping_file(log_dir: str) -> ExperimentWriter:
    """``CSVLogger``'s writer without its deletion of an existing ``metrics.csv`` (a process
    continuing the run, or a shadow pre-initialising, must not erase the log)."""
    writer = ExperimentWriter.__new__(ExperimentWriter)
    writer._check_log_dir_exists = lambda: None  # type: ignore[method-assign]
    ExperimentWriter.__init__(writer, log_dir)
    return writer


_MISSING = object()


def new_tensorboard_experiment(logger: Any, purge_step: int) -> Any:
    """A new ``SummaryWriter`` for ``logger`` that purges events from ``purge_step`` on (its file
    begins with ``SessionLog.START`` there); the user's own ``purge_step`` is put back after.
    ``TensorBoardLogger`` keeps the writer's arguments and the writer privately."""
    user = logger._kwargs.get("purge_step", _MISSING)
    logger._kwargs["purge_step"] = purge_step
    logger._experiment = None
    try:
        return logger.experiment
    finally:
        if user is _MISSING:
            logger._kwargs.pop("purge_step", None)
        else:
            logger._kwargs["purge_step"] = user


def event_file_name(experiment: Any) -> str | None:
    """The event file a ``torch.utils.tensorboard.SummaryWriter`` writes (None if unknown)."""
    writer = getattr(experiment, "file_writer", None)
    return getattr(getattr(writer, "event_writer", None), "_file_name", None)
