"""Device pages, host parity: the parity arithmetic of the CUDA backend.

With ``RetainedConfig(backend="cuda")`` data pages live in device memory and parity pages in
host memory (docs/design.md 2.2). ``ReedSolomonCode`` calls these functions whenever its data and
parity pages sit on different devices. What crosses PCIe (docs/cuda-backend.md):

* **delta** (every page a chunk transaction rewrites, once per tier): ``old ^ new`` is computed
  on the device; that one page goes to a pinned host buffer and the host engine folds
  ``coeff_j * delta`` into each of the m parity pages (ISA-L does so at memory speed, so
  multiplying on the host costs what XORing m ready-made products would, and 1 page crosses
  instead of m). Without ISA-L the m products are computed on the device by the torch engine
  and m pages cross: torch's byte-wise GF(2^8) multiply on a CPU is ~10x slower than its XOR.
* **encode** (gradients at prepare, re-encoding after recovery): parity is computed on the
  device from the D data pages; only the m parity pages cross. Pages of several devices (a
  tier-2 stripe across GPUs) are copied to the host and encoded there.
* **reconstruct / verify** (recovery only): the group's surviving data pages are copied to the
  host, the lost ones rebuilt there and copied back: about D + lost pages per group.

Every copy here is synchronous: when a function returns, host parity is final.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np
import torch

from ..errors import ConfigurationError
from .engines import get_engine
from .engines.base import ErasureEngine, check_pages

HOST = torch.device("cpu")
_local = threading.local()


class HostCode(Protocol):
    """What this module needs of a code (``ReedSolomonCode`` is one): its coefficients and its
    host-side rebuild and check. A protocol, so the codec calls down here and nothing here
    imports the codec back."""

    @property
    def m(self) -> int: ...

    @property
    def matrix(self) -> np.ndarray: ...

    def reconstruct(self, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor],
                    lost_data: Collection[int], lost_parity: Collection[int] = ()) -> None: ...

    def verify(self, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> list[int]: ...


def crosses(pages: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> bool:
    """True when some data page and the parity pages are on different devices."""
    return bool(parity) and any(p.device != parity[0].device for p in pages)


def ships_products(m: int, host_engine: ErasureEngine) -> bool:
    """Delta strategy: compute the m products on the device (True) or ship the delta (False)."""
    return m > 1 and host_engine.name != "isal"


def _buffer(kind: str, n: int, device: torch.device) -> torch.Tensor:
    """A per-thread reusable buffer of ``n`` bytes (host ones pinned when CUDA is usable:
    pinned memory is what DMA copies at full PCIe speed)."""
    cache = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    key = (kind, str(device))
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        pin = device.type == "cpu" and torch.cuda.is_available()
        buf = cache[key] = torch.empty(max(n, 1), dtype=torch.uint8, device=device, pin_memory=pin)
    return buf[:n]


def _check(pages: Sequence[torch.Tensor], parity: Sequence[torch.Tensor], what: str) -> int:
    """Validate each page alone (they may span devices) against host parity; return the length."""
    n = check_pages(parity, what="parity pages")
    if parity[0].device.type != "cpu":
        raise ConfigurationError(f"parity pages are on {parity[0].device}: with data pages on another device, "
                         "parity must be in host memory")
    for i, page in enumerate(pages):
        if check_pages([page], what=f"{what}[{i}]") != n:
            raise ConfigurationError(f"{what}[{i}] has {page.numel()} bytes, the parity pages {n}")
    return n


def apply_delta(code: HostCode, index: int, old: torch.Tensor, new: torch.Tensor,
                parity: Sequence[torch.Tensor], host_engine: ErasureEngine) -> None:
    """``parity_j ^= C[j, index] * (old ^ new)``: old and new on a device, parity on the host."""
    if len(parity) != code.m:
        raise ConfigurationError(f"got {len(parity)} parity pages; this code has m={code.m}")
    n = _check([old, new], parity, "delta pages")
    if old.device != new.device:
        raise ConfigurationError(f"old page on {old.device}, new page on {new.device}")
    if not code.m:
        return
    coeffs = code.matrix[:, index]
    delta = _buffer("delta", n, old.device)
    torch.bitwise_xor(old.reshape(-1), new.reshape(-1), out=delta)
    dsts = [p.view(-1) for p in parity]
    if ships_products(code.m, host_engine):
        products = _buffer("products", code.m * n, old.device).view(code.m, n)
        get_engine("torch").dot(coeffs.reshape(-1, 1), [delta], list(products))
        host = _buffer("staging", code.m * n, HOST).view(code.m, n)
        host.copy_(products)
        for dst, product in zip(dsts, host):
            host_engine.xor_into(dst, product)
    else:
        host = _buffer("staging", n, HOST)
        host.copy_(delta)
        host_engine.mad(coeffs, host, dsts)


def apply_contribution(code: HostCode, index: int, src: torch.Tensor,
                       parity: Sequence[torch.Tensor], host_engine: ErasureEngine) -> None:
    """``parity_j ^= C[j, index] * src`` for a device page: one page crosses."""
    n = _check([src], parity, "contribution page")
    if not code.m:
        return
    host = _buffer("staging", n, HOST)
    host.copy_(src.reshape(-1))
    host_engine.mad(code.matrix[:, index], host, [p.view(-1) for p in parity])


def encode(code: HostCode, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor],
           host_engine: ErasureEngine) -> None:
    """Overwrite host ``parity`` with the parity of device ``data``."""
    n = _check(data, parity, "data pages")
    if not code.m:
        return
    matrix = code.matrix[:, : len(data)]
    if len({p.device for p in data}) == 1:
        out = _buffer("products", code.m * n, data[0].device).view(code.m, n)
        get_engine("torch").dot(matrix, [p.reshape(-1) for p in data], list(out))
        for dst, row in zip(parity, out):
            dst.view(-1).copy_(row)
    else:  # one page from each of several devices (tier 2 across GPUs): encode on the host
        host_engine.dot(matrix, [p.to(HOST) for p in data], list(parity))


def reconstruct(code: HostCode, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor],
                lost_data: Collection[int], lost_parity: Collection[int]) -> None:
    """Rebuild lost device pages from host parity: survivors to the host, rebuild, copy back.

    Nothing is written when the loss exceeds the parity (the host rebuild raises first).
    """
    _check(data, parity, "data pages")
    lost = set(lost_data)
    host = [torch.empty_like(p, device=HOST) if i in lost else p.to(HOST, copy=True) for i, p in enumerate(data)]
    code.reconstruct(host, parity, lost_data, lost_parity)
    for i in sorted(lost):
        data[i].copy_(host[i])


def verify(code: HostCode, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> list[int]:
    """Indices of host parity pages that differ from a fresh encode of device ``data``."""
    _check(data, parity, "data pages")
    return code.verify([p.to(HOST) for p in data], parity)
