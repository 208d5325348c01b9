"""Deterministic synthetic token data for the recipes: nothing is downloaded, ever.

Why a seeded Markov chain: the sequences have learnable structure (each token has a few
likely successors), so the loss falls within a few dozen steps and a run that silently lost
or corrupted state shows up as a loss curve that differs from the fault-free one. Every
sequence is a pure function of (seed, split, index), so two runs, or a run and its resumed
self, see exactly the same batches. The dataset is a fixed-length map-style dataset so a
sampler position is all a resumable loader needs to record.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .config import RecipeConfig

__all__ = ["MarkovChain", "SyntheticTokens", "make_dataloaders"]

_SPLIT_OFFSET = {"train": 0, "val": 1_000_003}


class MarkovChain:
    """A sparse random first-order Markov chain over ``vocab_size`` tokens.

    Each token has ``branching`` successors with skewed probabilities, so the entropy rate is
    well below ``log(vocab_size)``: a model that learns the table reaches a much lower loss.
    """

    def __init__(self, vocab_size: int, seed: int, branching: int = 4) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=gen)
        weights = torch.rand(vocab_size, branching, generator=gen).pow(3) + 0.05
        self.probs = weights / weights.sum(dim=1, keepdim=True)

    def sample(self, n: int, length: int, seed: int) -> Tensor:
        """``n`` sequences of ``length`` tokens, a pure function of ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        out = torch.empty(n, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab_size, (n,), generator=gen)
        for t in range(1, length):
            prev = out[:, t - 1]
            choice = torch.multinomial(self.probs[prev], 1, generator=gen).squeeze(1)
            out[:, t] = self.successors[prev, choice]
        return out

    def entropy_rate(self) -> float:
        """Mean per-token entropy (nats) under the uniform start: a floor for the loss."""
        p = self.probs
        return float(-(p * p.log()).sum(dim=1).mean())


class SyntheticTokens(Dataset):
    """``n_sequences`` (input, target) pairs of ``seq_len`` tokens, targets shifted by one."""

    def __init__(self, vocab_size: int, seq_len: int, n_sequences: int, seed: int,
                 split: str = "train", branching: int = 4) -> None:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"split={split!r}: must be one of {sorted(_SPLIT_OFFSET)}")
        self.chain = MarkovChain(vocab_size, seed, branching)
        self.tokens = self.chain.sample(n_sequences, seq_len + 1, seed + _SPLIT_OFFSET[split])

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


def make_dataloaders(recipe: RecipeConfig, seed: int | None = None,
                     train_sequences: int = 1024, val_sequences: int = 64
                     ) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders for ``recipe.active`` (batch = ``data.micro_batch``).

    Not shuffled: the sequences are already i.i.d. samples, and an unshuffled loader makes
    the data position a plain batch count. Under DDP Lightning adds a DistributedSampler.
    """
    form = recipe.active
    seed = recipe.trainer.seed if seed is None else seed
    vocab, seq_len = form.model.vocab_size, form.model.seq_len
    train = SyntheticTokens(vocab, seq_len, train_sequences, seed, "train")
    val = SyntheticTokens(vocab, seq_len, val_sequences, seed, "val")
    batch = form.data.micro_batch
    return (DataLoader(train, batch_size=batch, shuffle=False, drop_last=True),
            DataLoader(val, batch_size=batch, shuffle=False, drop_last=False))
