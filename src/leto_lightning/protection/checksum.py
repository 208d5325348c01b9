"""Fast page checksums: detect damaged pages so repair can treat them as erasures.

Recovery verifies every page against the checksum recorded at commit; a mismatch marks
the page lost at a *known* position, which Reed-Solomon repairs with one parity page
per loss (docs/design.md 2.2, "Detection").

Algorithm: ISA-L's ``crc64_ecma_refl`` (CRC-64/XZ; 42-54 GB/s on one core here with its AVX-512
kernel, chosen below) from the same ``libisal`` the erasure engine loads; without ISA-L, ``zlib.crc32``
(slower, 32 bits). The two give different numbers, so ``CHECKSUM_ALGORITHM`` names the
active one and a store must record it and refuse to compare across algorithms.

Pages in device memory (the CUDA backend) are checksummed where they are, with
``device.HASH_ALGORITHM`` (a multilinear hash, ``protection/device.py``): a CRC is byte-serial,
and copying every page to the host to checksum it would move the whole state over PCIe at
every step. Which algorithm a page's checksum uses is a function of where the page lives
(``algorithm_for``), and a store's pages never move between host and device.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import ConfigurationError
from . import device as _device
from .engines.isal import load_isal
from .errors import PageTypeError

_lib, _ = load_isal()
_crc64: Any = getattr(_lib, "crc64_ecma_refl", None) if _lib is not None else None  # a ctypes function

# ISA-L's own dispatcher picks its AVX2 kernel on some AVX-512 CPUs (measured on an AMD EPYC with
# VPCLMULQDQ: 23-28 GB/s); the AVX-512 VPCLMULQDQ kernel computes the same CRC at 42-54 GB/s.
_WIDE_KERNEL = "crc64_ecma_refl_by16_10"
_WIDE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "vpclmulqdq"})
_SELF_TEST_LENGTHS = (1, 7, 63, 64, 65, 255, 256, 1000, 4096, 65536 + 13)


def _cpu_flags() -> frozenset[str]:
    """The CPU features the kernel enabled (Linux); empty where unknown (then nothing is assumed)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _wide_crc64(lib: Any, dispatched: Any) -> Any:
    """ISA-L's AVX-512 CRC-64 kernel when the CPU has what it executes and it agrees with the
    dispatched function on a self-test (the same CRC, so recorded checksums stay comparable);
    else the dispatched one. Why the flags first: a missing instruction would kill the process."""
    wide = getattr(lib, _WIDE_KERNEL, None)
    if wide is None or not _WIDE_FLAGS.issubset(_cpu_flags()):
        return dispatched
    wide.argtypes, wide.restype = dispatched.argtypes, dispatched.restype
    sample = torch.randint(0, 256, (max(_SELF_TEST_LENGTHS) + 64,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    for n in _SELF_TEST_LENGTHS:
        for start in (0, 3):  # aligned and unaligned starts
            ptr = sample.data_ptr() + start
            if wide(0, ptr, n) != dispatched(0, ptr, n) or wide(7, ptr, n) != dispatched(7, ptr, n):
                return dispatched
    return wide


if _crc64 is not None:
    _crc64 = _wide_crc64(_lib, _crc64)


def _crc64_ecma_refl(flat: torch.Tensor) -> int:
    return int(_crc64(0, flat.data_ptr() if flat.numel() else None, flat.numel()))


def _crc32_zlib(flat: torch.Tensor) -> int:
    return zlib.crc32(flat.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs lack it


_ALGORITHMS = {"crc32-zlib": _crc32_zlib}
if _crc64 is not None:
    _ALGORITHMS["crc64-ecma-refl"] = _crc64_ecma_refl

CHECKSUM_ALGORITHM: str = "crc64-ecma-refl" if _crc64 is not None else "crc32-zlib"
"""Name of the active checksum; checksums of different algorithms never compare equal."""


def crc64_address() -> int | None:
    """The C address of the active CRC-64 kernel (``uint64_t f(uint64_t crc, const uint8_t *buf,
    uint64_t len)``, chainable: ``f(f(0, a), b)`` is the checksum of ``a + b``), for compiled code
    that checksums pages as it writes them; None when the active algorithm is not CRC-64."""
    if _crc64 is None or CHECKSUM_ALGORITHM != "crc64-ecma-refl":
        return None
    return ctypes.cast(_crc64, ctypes.c_void_p).value


def available_algorithms() -> list[str]:
    """Checksum algorithms computable on this machine (the active one first)."""
    return sorted(_ALGORITHMS, key=lambda name: name != CHECKSUM_ALGORITHM)


def algorithm_for(device: torch.device) -> str:
    """The checksum of pages that live on ``device``: ``CHECKSUM_ALGORITHM`` in host memory,
    ``device.HASH_ALGORITHM`` in device memory (computed there)."""
    return CHECKSUM_ALGORITHM if device.type == "cpu" else _device.HASH_ALGORITHM


def _mul64(flat: torch.Tensor) -> int:
    return int(_device.page_hashes(flat.view(1, -1))[0]) & _U64


_U64 = (1 << 64) - 1


def _flat_bytes(page: torch.Tensor) -> torch.Tensor:
    if not isinstance(page, torch.Tensor):
        raise PageTypeError(f"page must be a torch.Tensor, got {type(page).__name__}")
    if not page.is_contiguous():
        raise PageTypeError("page must be contiguous (a checksum covers one flat byte range)")
    return page.reshape(-1).view(torch.uint8)


def checksum(page: torch.Tensor, algorithm: str | None = None) -> int:
    """Checksum of a contiguous tensor's bytes (any dtype), as an unsigned int.

    ``algorithm`` defaults to the one for the page's device (``algorithm_for``); pass a name to
    recompute checksums written with another one (a store written on a machine without ISA-L).
    """
    flat = _flat_bytes(page)
    name = algorithm or algorithm_for(flat.device)
    if name == _device.HASH_ALGORITHM:
        return _mul64(flat)
    fn = _ALGORITHMS.get(name)
    if fn is None:
        raise ConfigurationError(f"checksum algorithm {name!r} is not available here; "
                                 f"available: {available_algorithms()}")
    return fn(flat.cpu())


def checksum_many(pages: Iterable[torch.Tensor], algorithm: str | None = None) -> list[int]:
    """Checksums of several pages, in order."""
    return [checksum(p, algorithm) for p in pages]


def page_checksums(pages: torch.Tensor) -> list[int]:
    """The checksums of the rows of ``pages`` (``(P, page_bytes)``), as ``checksum`` gives them,
    in one batch: on a device one hash pass and one small copy back, instead of P."""
    if pages.device.type == "cpu":
        return [checksum(p) for p in pages]
    return [int(v) & _U64 for v in _device.page_hashes(pages).tolist()]
