"""Pure-torch erasure engine: byte-wise GF(2^8) on CPU or CUDA tensors.

Why this formulation: torch has no byte-table lookup without widening indices to
int32/int64 (4-8x the memory traffic), but multiplying by ``x`` (``xtime``) is four
cheap elementwise ops on uint8 -- ``(a << 1) ^ ((a >> 7) * 0x1d)``. A product
``c * s`` is then evaluated by Horner's rule over the bits of ``c``:

* ``dot`` (one parity row): ``acc = XOR of the sources whose coefficient has the top
  bit``; then for each lower bit ``acc = xtime(acc) ^ XOR(sources with that bit)``.
  A row costs at most 7 xtimes plus one XOR per set coefficient bit, and the all-ones
  row (plain XOR parity) costs only XORs.
* ``mad`` (one source into several parities): the powers ``x^t * src`` are built once
  and XORed into every parity whose coefficient has bit ``t``.

Pages are processed in blocks so the intermediates stay in cache on CPU; on GPU the
blocks are large and every op is a bandwidth-bound kernel. The result is bit-for-bit
the same code as ISA-L's (same field, same matrices).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...errors import ConfigurationError
from .base import ErasureEngine, check_matrix, check_operands

_CPU_BLOCK = 1 << 20
_GPU_BLOCK = 64 << 20


def _xtime(src: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """``out = x * src`` in GF(2^8) (0x11d); ``out`` may be ``src``; ``tmp`` is scratch."""
    torch.bitwise_right_shift(src, 7, out=tmp)
    tmp.mul_(0x1D)
    torch.bitwise_left_shift(src, 1, out=out)  # uint8: the carried-out bit is dropped
    out.bitwise_xor_(tmp)


def _top_bit(coeffs: np.ndarray) -> int:
    """Index of the highest set bit over all coefficients, -1 when all are zero."""
    return int(coeffs.max(initial=0)).bit_length() - 1


def _dot_row(row: np.ndarray, srcs: Sequence[torch.Tensor], dst: torch.Tensor, tmp: torch.Tensor) -> None:
    """``dst = XOR_i row[i] * srcs[i]`` by Horner's rule over the coefficient bits."""
    top = _top_bit(row)
    if top < 0:
        dst.zero_()
        return
    for bit in range(top, -1, -1):
        users = np.nonzero((row >> bit) & 1)[0]
        if bit == top:
            dst.copy_(srcs[int(users[0])])
            users = users[1:]
        else:
            _xtime(dst, dst, tmp)
        for i in users:
            dst.bitwise_xor_(srcs[int(i)])


def _mad_block(
    coeffs: np.ndarray, src: torch.Tensor, dsts: Sequence[torch.Tensor], power: torch.Tensor, tmp: torch.Tensor
) -> None:
    """``dsts[j] ^= coeffs[j] * src`` for one block, via the powers ``x^t * src``."""
    top = _top_bit(coeffs)
    current = src
    for bit in range(top + 1):
        if bit:
            _xtime(current, power, tmp)
            current = power
        for j in np.nonzero((coeffs >> bit) & 1)[0]:
            dsts[int(j)].bitwise_xor_(current)


class TorchEngine(ErasureEngine):
    """Erasure engine in plain torch ops; works on any device torch supports."""

    name = "torch"

    def __init__(self, block_bytes: int | None = None) -> None:
        """``block_bytes``: bytes per page processed at once.

        Default 1 MiB on CPU (measured: 128 KiB blocks lose half the speed to torch's
        per-op overhead, whole 4 MiB pages fall out of cache) and 64 MiB on GPU.
        """
        if block_bytes is not None and block_bytes < 1:
            raise ConfigurationError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes

    def _block(self, device: torch.device, length: int) -> int:
        if self.block_bytes is not None:
            return min(self.block_bytes, length)
        return min(_CPU_BLOCK if device.type == "cpu" else _GPU_BLOCK, length)

    def dot(self, matrix: np.ndarray, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
        """``dsts[j] = XOR_i matrix[j, i] * srcs[i]``, block by block, row by row."""
        length = check_operands(srcs, dsts)
        mat = check_matrix(matrix, len(dsts), len(srcs))
        if not dsts or length == 0:
            return
        flat_s = [s.view(-1) for s in srcs]
        flat_d = [d.view(-1) for d in dsts]
        block = self._block(flat_d[0].device, length)
        tmp = torch.empty(block, dtype=torch.uint8, device=flat_d[0].device)
        for off in range(0, length, block):
            end = min(off + block, length)
            chunk = [s[off:end] for s in flat_s]
            for j in range(len(flat_d)):
                _dot_row(mat[j], chunk, flat_d[j][off:end], tmp[: end - off])

    def mad(self, coeffs: np.ndarray, src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """``dsts[j] ^= coeffs[j] * src``, block by block."""
        length = check_operands([src], dsts)
        col = check_matrix(np.asarray(coeffs).reshape(-1, 1), len(dsts), 1)[:, 0]
        if not dsts or length == 0 or _top_bit(col) < 0:
            return
        flat_s = src.view(-1)
        flat_d = [d.view(-1) for d in dsts]
        block = self._block(flat_s.device, length)
        power = torch.empty(block, dtype=torch.uint8, device=flat_s.device)
        tmp = torch.empty_like(power)
        for off in range(0, length, block):
            end, n = min(off + block, length), min(block, length - off)
            _mad_block(col, flat_s[off:end], [d[off:end] for d in flat_d], power[:n], tmp[:n])
