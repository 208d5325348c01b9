"""The tiny OLMoE trains on CPU, its loss falls, and a rerun is bit-identical."""
from __future__ import annotations

import logging
import math
import os

import lightning as L
import pytest
import torch

from leto_lightning.models.config import load_recipe
from leto_lightning.models.data import MarkovChain, SyntheticTokens, make_dataloaders
from leto_lightning.models.lightning_module import MoELanguageModel, warmup_cosine


class _Losses(L.Callback):
    """Collects the per-step training loss."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.values.append(float(outputs["loss"]))


def _train(steps: int, overrides: tuple[str, ...] = ()) -> tuple[MoELanguageModel, list[float]]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    recipe = load_recipe("olmoe", [f"trainer.max_steps={steps}", *overrides])
    L.seed_everything(recipe.trainer.seed, verbose=False)
    module = MoELanguageModel.from_recipe(recipe)
    train, _ = make_dataloaders(recipe)
    losses = _Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, callbacks=[losses], limit_val_batches=0,
                        **recipe.trainer.lightning_kwargs())
    try:
        trainer.fit(module, train)
    finally:  # seed_everything exported PL_GLOBAL_SEED: do not leave it to later tests' forked ranks
        os.environ.pop("PL_GLOBAL_SEED", None)
    return module, losses.values


@pytest.fixture
def one_thread():
    """One intra-op thread: with other jobs on the 2 cores, 2 spinning threads run 5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tiny_olmoe_trains_and_is_bit_identical(one_thread: None) -> None:
    first, losses = _train(20)
    second, again = _train(20)
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    assert losses == again
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_scheduler_runs(one_thread: None) -> None:
    _, losses = _train(6, ("optimizer.scheduler=cosine", "optimizer.warmup_steps=2"))
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)


def test_warmup_cosine_shape() -> None:
    assert warmup_cosine(0, 4, 20, 0.1) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(4, 4, 20, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(12, 4, 20, 0.0) == pytest.approx(0.5)


def test_synthetic_data_is_deterministic_and_learnable() -> None:
    a = SyntheticTokens(512, 64, 8, seed=5)
    b = SyntheticTokens(512, 64, 8, seed=5)
    val = SyntheticTokens(512, 64, 8, seed=5, split="val")
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, val.tokens)
    inputs, targets = a[0]
    assert inputs.shape == targets.shape == (64,) and torch.equal(inputs[1:], targets[:-1])
    assert MarkovChain(512, seed=5).entropy_rate() < 0.5 * math.log(512)


def test_dataloaders_follow_recipe() -> None:
    recipe = load_recipe("kimi_moe")
    train, val = make_dataloaders(recipe)
    inputs, _targets = next(iter(train))
    assert inputs.shape == (recipe.tiny.data.micro_batch, recipe.tiny.model.seq_len)
    assert int(inputs.max()) < recipe.tiny.model.vocab_size and len(val.dataset) == 64
