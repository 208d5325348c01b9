"""Coding work that runs where the pages are: batched page hashes and XOR parity of many groups.

With data pages in device memory (the CUDA backend) the chunk transactions must not move every
page to the host to checksum it or to fold it into parity: a 1B-parameter AdamW update rewrites
12 GB of pages per step. So the device does the reading, and only results cross to the host:

* ``page_hashes``: one 64-bit checksum per page, computed on the pages' own device. CRC-64 is a
  byte-serial algorithm (ISA-L runs it on host memory); on a device the checksum is ``mul64-i32``,
  a multilinear hash of the page's little-endian int32 words ``x_i`` with fixed odd 64-bit weights
  ``w_i``: ``h = sum(w_i * x_i) mod 2**64``. Integer arithmetic, so any device (and the host, in
  the tests) gets the same bits in any summation order. A change of one word always changes it
  (``w_i`` is odd); for any fixed pattern of damage the chance that it is missed is at most
  ``2**-33`` over the weights, and ``2**-64`` for a random one -- the strength of a CRC-32 at
  worst, of a CRC-64 for random damage. A store records which algorithm its checksums use
  (``checksum.algorithm_for``): pages of one store never change device.
* ``xor_groups``: the XOR of each group's data pages (tier-1 parity when H1 = 1, whose generator
  row is all ones), for many groups at once. The caller copies the result -- one page per group --
  to the host parity pages (docs/cuda-backend.md).

Pure tensor arithmetic: it knows nothing of stores, and runs on CPU tensors as well (the tests).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import ConfigurationError

HASH_ALGORITHM = "mul64-i32"
# A batch of pages is widened to int64 to multiply: bound that temporary (bytes of int64 words).
_HASH_BATCH_BYTES = 64 << 20


@functools.lru_cache(maxsize=8)
def _host_weights(n_words: int) -> np.ndarray:
    """The fixed odd weights ``w_i`` (splitmix64 of ``i + 1``, lowest bit set), as int64."""
    with np.errstate(over="ignore"):
        z = (np.arange(1, n_words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


_DEVICE_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def hash_weights(n_words: int, device: torch.device) -> torch.Tensor:
    """``w`` on ``device`` (made once per device and page size)."""
    key = (str(device), n_words)
    w = _DEVICE_WEIGHTS.get(key)
    if w is None:
        w = _DEVICE_WEIGHTS[key] = torch.from_numpy(_host_weights(n_words).copy()).to(device)
    return w


def page_hashes(pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``mul64-i32`` of each row of ``pages`` (``(P, page_bytes)`` uint8, rows a multiple of 4
    bytes): an int64 tensor of P checksums on the pages' device. Nothing is synchronised: the
    caller reads the result when it needs it (one small copy to the host for a whole chunk)."""
    if pages.dim() != 2 or pages.dtype != torch.uint8 or pages.shape[1] % 4:
        raise ConfigurationError(f"page_hashes takes (pages, bytes) uint8 rows of a multiple of 4 bytes, got "
                                 f"{tuple(pages.shape)} {pages.dtype}")
    n_pages, n_words = pages.shape[0], pages.shape[1] // 4
    if out is None:
        out = torch.empty(n_pages, dtype=torch.int64, device=pages.device)
    words = pages.view(torch.int32)
    weights = hash_weights(n_words, pages.device)
    step = max(1, _HASH_BATCH_BYTES // (8 * max(n_words, 1)))
    for start in range(0, n_pages, step):
        wide = words[start : start + step].to(torch.int64)  # sign-extended: the sum is taken mod 2**64
        wide.mul_(weights)
        torch.sum(wide, dim=1, out=out[start : start + step])
    return out


def xor_groups(pages: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[g] = XOR over d of pages[index[g, d]]``: the XOR parity of G groups of D pages each.

    ``pages``: ``(n_pages, page_bytes)`` uint8 (all of a store's pages); ``index``: ``(G, D)`` int64
    page numbers on the same device; ``out``: ``(G, page_bytes)`` uint8. The XOR runs on 64-bit
    words (page sizes are multiples of 64 bytes): per column of ``index`` one gather and one XOR
    over all G groups, and nothing waits for the device. A short group (fewer than D pages, the
    last of a region) goes through ``xor_pages``.
    """
    if index.dim() != 2 or index.shape[1] < 1 or out.shape[0] != index.shape[0] or out.shape[1] != pages.shape[1]:
        raise ConfigurationError(f"xor_groups: index {tuple(index.shape)}, out {tuple(out.shape)} and pages "
                                 f"{tuple(pages.shape)} do not fit")
    words, dst = pages.view(torch.int64), out.view(torch.int64)
    torch.index_select(words, 0, index[:, 0], out=dst)
    for d in range(1, index.shape[1]):
        dst.bitwise_xor_(words.index_select(0, index[:, d]))
    return out


def xor_pages(pages: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = XOR of pages`` (1-D uint8 pages of one length, on one device)."""
    dst = out.view(torch.int64)
    dst.copy_(pages[0].view(torch.int64))
    for page in pages[1:]:
        dst.bitwise_xor_(page.view(torch.int64))
    return out
