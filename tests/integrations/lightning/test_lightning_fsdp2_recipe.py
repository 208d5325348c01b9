"""A tiny MoE recipe under ``trainer.strategy=leto_fsdp2``: ``MoELanguageModel.configure_model``
shards each transformer block and the root with ``fully_shard``; two forked gloo ranks train a
few steps exactly as under Lightning's ``ModelParallelStrategy`` (local shards, AdamW state,
losses bit-identical). ``leto train`` validates the setting before any trainer starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from lightning_fsdp2_job import WORLD, as_rank, run_lightning_ranks

from leto_lightning import new_job_id
from leto_lightning.errors import ConfigurationError
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.testing.launched import free_port

RECIPE = "gpt_moe"
STEPS = 2
SMALLER = ["tiny.model.n_layers=2", "tiny.data.global_batch=4", "tiny.data.micro_batch=2"]  # test time


@dataclass(frozen=True)
class RecipeJob:
    out_dir: str
    port: int
    job_id: str = ""  # set: strategy="leto_fsdp2"; empty: ModelParallelStrategy (the reference)


def train_recipe(job: RecipeJob, rank: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from leto_lightning.integrations.lightning import LetoModelParallelStrategy
    from leto_lightning.models.config import load_recipe
    from leto_lightning.models.data import make_dataloaders
    from leto_lightning.models.lightning_module import MoELanguageModel

    as_rank(rank, job.port)
    recipe = load_recipe(RECIPE, [f"trainer.max_steps={STEPS}", "trainer.strategy=leto_fsdp2", *SMALLER])
    pl.seed_everything(recipe.trainer.seed, workers=True, verbose=False)
    module = MoELanguageModel.from_recipe(recipe)
    train, _ = make_dataloaders(recipe)
    strategy = (LetoModelParallelStrategy(job_id=job.job_id, page_bytes=recipe.leto.page_bytes) if job.job_id else
                ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1))
    losses: list[torch.Tensor] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(outputs["loss"].detach().clone())

        def on_train_end(self, trainer, pl_module) -> None:
            params = [p.to_local().clone() for p in pl_module.parameters()]
            torch.save({"params": params, "losses": losses, "sharded": getattr(trainer.strategy, "sharded", None)
                        is not None}, os.path.join(job.out_dir, f"r{rank}.pt"))

    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                         limit_val_batches=0, callbacks=[Record()], **recipe.trainer.lightning_kwargs())
    trainer.fit(module, train)
    torch.distributed.destroy_process_group()


def run(tmp_path, name: str, **kw) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    codes = run_lightning_ranks(RecipeJob(str(out), port=free_port(), **kw), timeout=180, train=train_recipe)
    assert codes == dict.fromkeys(range(WORLD), 0), f"{name}: rank exit codes {codes}"
    return [torch.load(out / f"r{r}.pt") for r in range(WORLD)]


def test_tiny_moe_recipe_trains_sharded_bit_identical_to_model_parallel(tmp_path) -> None:
    plain = run(tmp_path, "plain")
    job_id = new_job_id()
    try:
        leto = run(tmp_path, "leto", job_id=job_id)
    finally:
        unlink_segments(job_id)
    for rank, (a, b) in enumerate(zip(plain, leto)):
        assert b["sharded"] and not a["sharded"]
        assert len(a["losses"]) == len(b["losses"]) == STEPS
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])), f"rank {rank}: losses"
        assert len(a["params"]) == len(b["params"]) > 10
        for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
            assert torch.equal(x, y), f"rank {rank}: param {i} differs"
    assert plain[0]["params"][0].shape[0] * WORLD >= 512  # the embedding is sharded by rows


def test_leto_train_validates_the_strategy_before_launching(tmp_path) -> None:
    from leto_lightning.train import build_agent

    with pytest.raises(ConfigurationError, match=r"trainer.strategy='fsdp'.*must be one of \('leto', 'leto_fsdp2'\)"):
        build_agent(RECIPE, ["trainer.strategy=fsdp"], str(tmp_path / "a"))
    with pytest.raises(ConfigurationError, match="is a Lightning strategy: use it with --trainer lightning"):
        build_agent(RECIPE, ["trainer.strategy=leto_fsdp2"], str(tmp_path / "b"), trainer="accelerate")
