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

    from leto_lightning.integrations.lightning import LetoStrategy
    from leto_lightning.models.config import load_recipe
    from leto_lightning.models.data import make_dataloaders
    from leto_lightning.models.lightning_module import MoELanguageModel
    from leto_lightning.runtime.contract import RUN_DIR, WANDB
    from leto_lightning.runtime.storage import atomic_torch_save

    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    recipe = load_recipe(recipe_file)
    run_dir = os.environ.get(RUN_DIR, ".")
    pl.seed_everything(recipe.trainer.seed, workers=True)
    model = MoELanguageModel.from_recipe(recipe)
    train, val = make_dataloaders(recipe)
    leto = recipe.leto
    strategy = LetoStrategy(page_bytes=leto.page_bytes, data_pages=leto.data_pages, tier1_parity=leto.tier1_parity,
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
    atomic_torch_save({"params": [p.detach().clone() for p in model.parameters()],  # never half-written
                       "optimizer": trainer.optimizers[0].state_dict()}, os.path.join(run_dir, f"final_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
