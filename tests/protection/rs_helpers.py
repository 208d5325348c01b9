"""Helpers shared by the protection tests (a uniquely named module: no package needed)."""

from __future__ import annotations

import numpy as np
import torch

from leto_lightning.protection import gf256


def random_pages(rng: np.random.Generator, count: int, length: int) -> list[torch.Tensor]:
    return [torch.from_numpy(rng.integers(0, 256, length, dtype=np.uint8)) for _ in range(count)]


def reference_dot(matrix: np.ndarray, srcs: list[torch.Tensor]) -> list[np.ndarray]:
    """Slow but obviously right: table lookups per coefficient, in numpy."""
    out = []
    for row in matrix:
        acc = np.zeros(srcs[0].numel(), dtype=np.uint8)
        for c, s in zip(row, srcs):
            acc ^= gf256.MUL_TABLE[c][s.numpy()]
        out.append(acc)
    return out
