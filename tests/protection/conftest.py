"""Shared helpers for the protection tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leto_lightning.protection import gf256
from leto_lightning.protection.engines import available_engines, get_engine

ENGINE_NAMES = available_engines()


@pytest.fixture(params=ENGINE_NAMES)
def engine(request):
    """Every engine that can run on this machine."""
    return get_engine(request.param)


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
