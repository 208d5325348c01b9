"""A prepared, shuffled loader put back at a position after epoch 0 yields exactly what the
uninterrupted loader yielded from there, and the random state after each batch is the same --
with the default ``RandomSampler`` (its order depends on the generator state at ``iter()``) and
with ``use_seedable_sampler=True``, for both payload kinds (restored when the next batch is
fetched, or before the fetch)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from leto_lightning.integrations.accelerate.loader import Position, positioned

EPOCHS = 3


class Hooks:
    """The two calls a positioned loader makes to its accelerator; records the hook's positions."""

    def __init__(self) -> None:
        self.at_hook: list[dict] = []

    def _leto_iter_started(self, loader) -> None:
        pass

    def _leto_before_batch(self, loader) -> None:
        self.at_hook.append(loader.leto_position())


def _loader(seedable: bool):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    data = torch.utils.data.TensorDataset(torch.arange(40))
    loader = acc.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    hooks = Hooks()
    return positioned(loader, hooks, 0), hooks


def _train(loader, first_epoch: int, after_batch=None) -> list[tuple]:
    """(epoch, batch, a random draw after it): what a loop sees, the draw standing for dropout."""
    seen = []
    for epoch in range(first_epoch, EPOCHS):
        for (batch,) in loader:
            seen.append((epoch, batch.tolist(), torch.rand(1).item()))
            if after_batch is not None:
                after_batch(loader, len(seen))
    return seen


@pytest.mark.parametrize("seedable", [False, True], ids=["RandomSampler", "seedable"])
@pytest.mark.parametrize("kind", ["boundary", "prepare"])
def test_a_shuffled_loader_resumes_mid_epoch_after_epoch_0(seedable: bool, kind: str) -> None:
    torch.manual_seed(0)
    loader, hooks = _loader(seedable)
    stop_at = 10 + 4  # the 5th batch of epoch 1 (10 batches per epoch)
    captured: dict = {}

    def capture(dl, n: int) -> None:  # inside the "step" after batch n - 1: a prepare payload
        if n == stop_at:
            captured.update(dl.leto_position())

    seen = _train(loader, 0, capture)
    assert [e for e, _, _ in seen] == [0] * 10 + [1] * 10 + [2] * 10
    assert seen[0][1] != seen[10][1]  # epoch 1 has its own order

    torch.manual_seed(123)  # the resumed process: other random state, a new loader
    resumed, _ = _loader(seedable)
    if kind == "boundary":  # the hook before batch stop_at: that batch comes next
        where = hooks.at_hook[stop_at]
        resumed._leto_pending = Position(where["yielded"], where["epoch_rng"], where["rng"], at_yield=True)
    else:  # the step of batch stop_at - 1: the batch after it comes next
        where = captured
        resumed._leto_pending = Position(where["yielded"], where["epoch_rng"], where["rng"], at_yield=False)
    resumed.iteration = where["epoch"]
    assert (where["epoch"], where["yielded"]) == (1, 4)
    assert _train(resumed, where["epoch"]) == seen[stop_at:]
