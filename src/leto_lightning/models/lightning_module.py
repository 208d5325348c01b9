"""``MoELanguageModel``: the recipes' transformer as a Lightning module.

Kept thin on purpose: the model itself (``moe_transformer``) is pure torch so the layers
below the integration can build it; this wrapper only adds the loss, logging and the
optimizer/scheduler that a recipe specifies. Hyperparameters are stored as plain dicts so a
checkpoint can rebuild the module without the recipe file.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule, fully_shard

from .config import ModelConfig, OptimizerConfig, RecipeConfig
from .moe_transformer import MoETransformer, build_model

__all__ = ["MoELanguageModel", "warmup_cosine"]

Batch = tuple[Tensor, Tensor]


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup`` steps, cosine to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _as_dict(cfg: ModelConfig | OptimizerConfig | dict[str, Any]) -> dict[str, Any]:
    """Dataclass or mapping to a plain dict (what ``save_hyperparameters`` can store)."""
    return asdict(cfg) if not isinstance(cfg, dict) else dict(cfg)


class MoELanguageModel(L.LightningModule):
    """Next-token cross-entropy plus ``aux_loss_coef`` times the MoE load-balancing loss."""

    def __init__(self, model: ModelConfig | dict[str, Any],
                 optimizer: OptimizerConfig | dict[str, Any] | None = None,
                 aux_loss_coef: float = 0.01, max_steps: int = -1,
                 init_seed: int | None = None) -> None:
        super().__init__()
        model_dict = _as_dict(model)
        optim_dict = _as_dict(optimizer if optimizer is not None else OptimizerConfig())
        self.save_hyperparameters({"model": model_dict, "optimizer": optim_dict,
                                   "aux_loss_coef": aux_loss_coef, "max_steps": max_steps,
                                   "init_seed": init_seed})
        self.model_config = ModelConfig(**model_dict)
        self.optimizer_config = OptimizerConfig(**optim_dict)
        self.aux_loss_coef = aux_loss_coef
        self.net: MoETransformer = build_model(self.model_config, seed=init_seed)

    @classmethod
    def from_recipe(cls, recipe: RecipeConfig, aux_loss_coef: float = 0.01) -> MoELanguageModel:
        """Build the active size form with weights seeded by ``trainer.seed``."""
        return cls(recipe.active.model, recipe.optimizer, aux_loss_coef=aux_loss_coef,
                   max_steps=recipe.trainer.max_steps, init_seed=recipe.trainer.seed)

    def configure_model(self) -> None:
        """Under a sharding strategy (``strategy="leto_fsdp2"``, Lightning's
        ``ModelParallelStrategy``): FSDP2 per transformer block, then the rest of the net (the
        embedding, final norm and LM head) as the root group. Other strategies set no device
        mesh: the model stays whole (DDP)."""
        mesh = self.device_mesh
        if mesh is None or isinstance(self.net, FSDPModule):  # not sharding, or sharded by an earlier fit
            return
        data_parallel = mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=data_parallel)
        fully_shard(self.net, mesh=data_parallel)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        return self.net(tokens)

    def _losses(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """(total, cross-entropy, aux) for one (inputs, targets) batch."""
        inputs, targets = batch
        logits, aux = self.net(inputs)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce + self.aux_loss_coef * aux, ce, aux

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, ce, aux = self._losses(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train/ce", ce, on_step=True, on_epoch=False)
        if self.model_config.is_moe:
            self.log("train/aux", aux, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, ce, _ = self._losses(batch)
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val/ce", ce, on_epoch=True, sync_dist=True)
        return loss

    def _param_groups(self) -> list[dict[str, Any]]:
        """Weight decay on matrices only (norm weights are 1-D), in a deterministic order."""
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for _, param in sorted(self.net.named_parameters(), key=lambda kv: kv[0]):
            (decay if param.ndim >= 2 else no_decay).append(param)
        wd = self.optimizer_config.weight_decay
        return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]

    def _total_steps(self) -> int:
        """Schedule length: the trainer's max_steps when attached, else the constructor's."""
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer (Lightning's property raises then)
            trainer = None
        trainer_steps = getattr(trainer, "max_steps", -1) if trainer else -1
        steps = trainer_steps if trainer_steps and trainer_steps > 0 else self.hparams["max_steps"]
        return max(int(steps), 1)

    def configure_optimizers(self) -> Any:
        cfg = self.optimizer_config
        optimizer = torch.optim.AdamW(self._param_groups(), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]),
                                      eps=cfg.eps)
        if cfg.scheduler == "none":
            return optimizer
        total = self._total_steps()
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, cfg.warmup_steps, total, cfg.min_lr_ratio))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
