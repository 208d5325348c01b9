"""The small language model and batches of the crash tests, the examples and the baselines.

Pure torch (no other leto_lightning import), so a baseline that must not pay Leto's imports can
use it too: every run that is compared bit for bit builds exactly this model from this data.
"""

from __future__ import annotations

import torch


class TinyLM(torch.nn.Module):
    """Embedding -> MLP block -> LayerNorm -> head: params of many shapes, some tiny."""

    def __init__(self, vocab: int = 97, dim: int = 48) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))


def rank_batch(rank: int, iteration: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed (inputs, targets) of one rank's iteration: the data position is the iteration."""
    g = torch.Generator().manual_seed(1_000_003 * rank + iteration)
    tokens = torch.randint(0, vocab, (8, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
