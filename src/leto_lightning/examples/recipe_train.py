"""The training script behind ``leto train``: a recipe's model with ``Trainer(strategy="leto")``.

    leto launch --nproc-per-node 2 recipe_train.py RUN_DIR/recipe.yaml
"""

from __future__ import annotations

import os
import sys

import torch


def main(recipe_file: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

    from leto_lightning.env import RUN_DIR, WANDB
    from leto_lightning.integrations.lightning import LetoModelParallelStrategy, LetoStrategy
    from leto_lightning.models.config import load_recipe
    from leto_lightning.models.data import make_dataloaders
    from leto_lightning.models.lightning_module import MoELanguageModel
    from leto_lightning.runtime.storage import atomic_torch_save

    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    recipe = load_recipe(recipe_file)
    run_dir = os.environ.get(RUN_DIR, ".")
    pl.seed_everything(recipe.trainer.seed, workers=True)
    model = MoELanguageModel.from_recipe(recipe)
    train, val = make_dataloaders(recipe)
    leto = recipe.leto
    # trainer.strategy: "leto" (DDP) or "leto_fsdp2" (the module's configure_model shards per block)
    strategy_class = LetoModelParallelStrategy if recipe.trainer.strategy == "leto_fsdp2" else LetoStrategy
    strategy = strategy_class(page_bytes=leto.page_bytes, data_pages=leto.data_pages, tier1_parity=leto.tier1_parity,
                              tier2_parity=leto.tier2_parity, shadow_level=leto.shadow_level)
    loggers: list[Logger] = [CSVLogger(run_dir, name="csv", version=0)]
    if os.environ.get(WANDB, "1") != "0":
        loggers.append(WandbLogger(project=f"leto-{recipe.name}", save_dir=run_dir, offline=True,
                                   name=os.path.basename(os.path.abspath(run_dir))))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=recipe.active.parallelism.dp,
                         logger=loggers, deterministic=True, enable_checkpointing=False,
                         enable_progress_bar=int(os.environ.get("RANK", "0")) == 0,
                         **recipe.trainer.lightning_kwargs())
    trainer.fit(model, train, val)
    rank = int(os.environ.get("RANK", "0"))
    final = {"params": list(model.parameters()), "optimizer": trainer.optimizers[0].state_dict()}
    atomic_torch_save(_local_copy(final), os.path.join(run_dir, f"final_rank{rank}.pt"))  # never half-written


def _local_copy(value: object) -> object:
    """Plain copies of every tensor (FSDP2: this rank's local shards), nothing shared with the
    retained store or with FSDP2's buffers."""
    if isinstance(value, torch.Tensor):
        return (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
    if isinstance(value, dict):
        return {k: _local_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local_copy(v) for v in value)
    return value


if __name__ == "__main__":
    main(sys.argv[1])
