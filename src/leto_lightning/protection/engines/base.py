"""The interface every erasure engine implements, plus shared argument checks.

An engine does only bulk GF(2^8) arithmetic on pages (contiguous ``torch.uint8``
tensors of equal length); which coefficients to use is the codec's business. Keeping
the interface this small lets a C library (ISA-L), pure torch (CPU or GPU) or a future
fused kernel be swapped without touching the codec.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np
import torch

from ...errors import ConfigurationError
from ..errors import PageTypeError


class ErasureEngine(abc.ABC):
    """Bulk GF(2^8) page arithmetic: dot products and multiply-accumulate."""

    name: str = "abstract"

    @abc.abstractmethod
    def dot(self, matrix: np.ndarray, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
        """Overwrite ``dsts[j]`` with XOR_i ``matrix[j, i] * srcs[i]`` (matrix is r x k)."""

    @abc.abstractmethod
    def mad(self, coeffs: np.ndarray, src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """In place ``dsts[j] ^= coeffs[j] * src``: the parity-delta primitive."""

    def xor_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """In place ``dst ^= src`` (plain XOR runs at memory speed in torch)."""
        check_pages([dst, src], what="xor_into pages")
        dst.bitwise_xor_(src)

    def xor_fold(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        """In place ``dst ^= srcs[0] ^ srcs[1] ^ ...`` (operands validated by the caller): the
        delta of an all-ones parity row. Here one word-wide torch XOR per source."""
        if all(t.numel() % 8 == 0 and t.data_ptr() % 8 == 0 for t in (dst, *srcs)):
            words = dst.view(-1).view(torch.int64)
            for src in srcs:
                words.bitwise_xor_(src.view(-1).view(torch.int64))
            return
        for src in srcs:
            dst.bitwise_xor_(src)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_pages(pages: Sequence[torch.Tensor], *, what: str, cpu_only: bool = False) -> int:
    """Validate that pages are contiguous uint8 tensors of one length on one device.

    Returns the common length in bytes. Raises PageTypeError (a TypeError) for wrong kinds of
    tensors and ConfigurationError (a ValueError) for mismatched lengths or devices.
    """
    length = -1
    device = None
    for i, page in enumerate(pages):
        if not isinstance(page, torch.Tensor):
            raise PageTypeError(f"{what}[{i}] must be a torch.Tensor, got {type(page).__name__}")
        if page.dtype != torch.uint8:
            raise PageTypeError(f"{what}[{i}] must have dtype torch.uint8, got {page.dtype}")
        if not page.is_contiguous():
            raise PageTypeError(f"{what}[{i}] must be contiguous (pages are flat byte ranges)")
        if cpu_only and page.device.type != "cpu":
            raise PageTypeError(f"{what}[{i}] is on {page.device}; this engine works on CPU tensors only")
        if length < 0:
            length, device = page.numel(), page.device
        elif page.numel() != length:
            raise ConfigurationError(f"{what}[{i}] has {page.numel()} bytes, expected {length} like the others")
        elif page.device != device:
            raise ConfigurationError(f"{what}[{i}] is on {page.device}, the others on {device}")
    return max(length, 0)


def check_operands(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], *, cpu_only: bool = False
) -> int:
    """Validate sources and destinations together; return their common length."""
    n_src = check_pages(srcs, what="srcs", cpu_only=cpu_only)
    n_dst = check_pages(dsts, what="dsts", cpu_only=cpu_only)
    if srcs and dsts:
        if n_src != n_dst:
            raise ConfigurationError(f"source pages have {n_src} bytes but destination pages {n_dst}")
        if srcs[0].device != dsts[0].device:
            raise ConfigurationError(f"source pages are on {srcs[0].device}, destinations on {dsts[0].device}")
    check_no_overlap(srcs, dsts)
    return n_src if srcs else n_dst


def check_no_overlap(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """Reject destinations that share bytes with sources or with each other.

    The engines read sources while writing destinations in blocks; aliasing would
    silently produce wrong parity, so it is refused up front.
    """
    spans = [(t.data_ptr(), t.data_ptr() + t.numel(), f"dst {j}") for j, t in enumerate(dsts) if t.numel()]
    others = [(t.data_ptr(), t.data_ptr() + t.numel(), f"src {i}") for i, t in enumerate(srcs) if t.numel()]
    for n, (lo, hi, label) in enumerate(spans):
        for lo2, hi2, label2 in spans[n + 1 :] + others:
            if lo < hi2 and lo2 < hi:
                raise ConfigurationError(f"{label} overlaps {label2}: destinations must not alias any other page")


def check_matrix(matrix: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Return ``matrix`` as a C-contiguous uint8 (rows x cols) array or raise ValueError."""
    arr = np.ascontiguousarray(matrix)
    if arr.dtype != np.uint8:
        if arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 255)):
            raise ConfigurationError(f"coefficients must be integers in 0..255 (numpy uint8), got {arr.dtype}")
        arr = arr.astype(np.uint8)
    if arr.shape != (rows, cols):
        raise ConfigurationError(f"coefficient matrix has shape {arr.shape}, expected ({rows}, {cols}) "
                                 "for the pages given")
    return arr
