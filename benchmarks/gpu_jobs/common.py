"""What the two GPU job scripts share: a small deterministic transformer LM and its data.

Written the way a user writes a training script. Deterministic on CUDA: the attention is written
out (no fused SDPA kernel, whose backward may not be), and the scripts turn on torch's
deterministic algorithms (with ``CUBLAS_WORKSPACE_CONFIG`` as cuBLAS requires).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 256, 64


def deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def dataset(n: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    tokens[:, 1::2] = (tokens[:, 0:-1:2] * 7 + 3) % VOCAB  # learnable: every other token follows its predecessor
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def cosine(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def final_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Host copies of the weights and the optimizer state, for torch.equal across runs."""
    def host(v):
        return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    opt = optimizer.state_dict()
    return {"params": {n: host(p) for n, p in model.named_parameters()},
            "optimizer": {"state": {i: {k: host(v) for k, v in s.items()} for i, s in opt["state"].items()},
                          "param_groups": opt["param_groups"]}}
