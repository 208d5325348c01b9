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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from ...errors import ConfigurationError
from ...retained.config import RetainedConfig
from ...runtime.engine import RankPlace
from ...runtime.storage import replace_dir
from ...updater.fsdp2 import RetainedFSDP2
from .checks import check_sharded_model, check_sharded_trainer
from .fit_hooks import LetoFitHooks, file_payload, leto_settings
from .frozen import FrozenPayload
from .internals import saves_distributed_checkpoint, shard_every_rank
from .options import RETAINED_CKPT
from .proxy import proxy_for
from .resume import apply_param_groups

FSDP2_STRATEGY_NAME = "leto_fsdp2"


class LetoModelParallelStrategy(LetoFitHooks, ModelParallelStrategy):
    """FSDP2 with retained local shards and crash-consistent updates (module doc).

    Takes ``LetoStrategy``'s options (``retained=RetainedConfig(...)`` or its fields one by
    one, ``job_id``, ``resume``, ``shadow_level``, heartbeats, ``keep_retained``) and
    ``ModelParallelStrategy``'s; ``data_parallel_size`` defaults to every rank and
    ``tensor_parallel_size`` must stay 1 (the retained binding supports ``Shard(0)`` on a 1-D
    mesh).
    """

    strategy_name = FSDP2_STRATEGY_NAME
    leto_description = "Leto: FSDP2 (fully_shard) with retained local shards"

    def __init__(self, *, retained: RetainedConfig | None = None, job_id: str | None = None,
                 resume: str | None = None, shadow_level: int | str = 3, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 60.0, keep_retained: bool = False, **kwargs: Any) -> None:
        settings = leto_settings(kwargs, retained, job_id, resume, shadow_level, heartbeat_interval,
                                 heartbeat_timeout)
        cluster_environment = kwargs.pop("cluster_environment", None)  # ModelParallelStrategy takes none
        if kwargs.get("tensor_parallel_size", 1) not in (1, "auto"):
            raise ConfigurationError(f"tensor_parallel_size={kwargs['tensor_parallel_size']!r}: {type(self).__name__} "
                                     "retains FSDP2 shards on a 1-D data-parallel mesh; leave tensor_parallel_size=1")
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)
        self.cluster_environment = cluster_environment
        self._leto_state(settings, keep_retained)

    @property
    def sharded(self) -> RetainedFSDP2 | None:
        """The binding of the local shards (the engine's; ``retained`` is its optimizer)."""
        return self.engine.sharded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """A checkpoint built from a Leto payload carries the hyper-parameters (lr, ...) to apply
        (``load_optimizer_state_dict``); a plain distributed checkpoint loaded them itself."""
        return self.fit_state.mode.from_retained_memory or self.resume_payload is not None

    @override
    def setup_environment(self) -> None:
        shard_every_rank(self)
        super().setup_environment()

    @override
    def _setup_distributed(self) -> None:
        self._session_group_or(super()._setup_distributed)

    # -- setup -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_sharded_trainer(self, trainer)
            self._install_loop_state(trainer)
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
        if not self.module.automatic_optimization:
            raise ConfigurationError(f"{type(self).__name__}: manual optimization is not supported with retained "
                                     "FSDP2 shards yet; use automatic optimization or strategy='leto' (DDP)")
        optimizer = self._begin_binding(trainer)
        assert self.model is not None and self.job_id is not None
        shown = [list(group["params"]) for group in optimizer.param_groups]  # the DTensor params, for clipping
        place = RankPlace(self.global_rank, self.node_rank, self.local_rank, self.num_processes)
        bound = self.engine.bind_fsdp2(self.model, optimizer, self.retained_config, job_id=self.job_id, place=place,
                                       barrier=self._prepare_barrier(), payload_fn=self._payload_fn(trainer),
                                       continuing=self.fit_state.mode.from_retained_memory)
        if self.fit_state.mode.from_retained_memory:
            self.resume_payload = self.engine.resume()  # a level-3 shadow waits here, fully built
        self.logs.continue_from(trainer, self.resume_payload)
        self._proxy = proxy_for(optimizer, self._retained_step, shown)
        assert bound is self.sharded

    def _binding_step(self, closure: Callable | None) -> Any:
        assert self.sharded is not None
        return self.sharded.step(closure)

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
        self._checkpoint_saved(checkpoint)

    # -- resume --------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if str(checkpoint_path) == RETAINED_CKPT:
            return self._retained_checkpoint()
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
        return self._payload_checkpoint()

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

    def release(self, unlink: bool = False) -> None:
        """Copy the shards out of retained memory (the model stays usable), then drop this
        process's mappings; ``unlink=True`` also frees the job's retained memory."""
        if self.sharded is not None:
            self.sharded.detach()
        super().release(unlink)


LetoModelParallelStrategy.register_strategies(StrategyRegistry)
