"""ISA-L erasure engine: Intel's SIMD Reed-Solomon kernels through ctypes, zero copy.

ISA-L (``libisal``) is what Ceph, HDFS and MinIO use; it runs at memory speed on one
core and ``ec_encode_data_update`` *is* the parity-delta primitive
(``parity_j ^= g_j,i * src``). We call it on the tensors' ``data_ptr()`` so no byte is
copied. The library is found, in order, at ``$LETO_ISAL_LIBRARY``, by the system loader
(Debian/Ubuntu ``libisal2``), or inside the ``pyeclib`` wheel (``pyeclib.libs/``), which
is a declared dependency of this project, so ``pip install`` provides it.

Lengths: ISA-L's dispatched functions accept any ``len >= 1``: for lengths below the
SIMD width (16/32/64 bytes) they fall back to the portable byte loop, and the
AVX-512/GFNI kernels mask their tails. ``len`` is a C ``int``, so pages of 2 GiB or more
are processed in 1 GiB slices. No alignment is required.

The ``g_tbls`` expansion layout depends on the CPU (32 bytes per coefficient for
PSHUFB kernels, 8 for GFNI), so it is treated as opaque and always produced by the
library's own dispatched ``ec_init_tables``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import EngineUnavailableError
from .base import ErasureEngine, check_matrix, check_operands

_SLICE = 1 << 30  # ISA-L takes `int len`: stay far below 2**31
_TABLE_CACHE_SIZE = 512
_REQUIRED = ("ec_init_tables", "ec_encode_data", "ec_encode_data_update")

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None


def _candidates() -> Iterator[str]:
    """Places to look for libisal, most explicit first.

    ``$LETO_ISAL_LIBRARY`` comes from ``env.isal_library``: the one environment read below
    ``runtime/`` (``tests/test_environment_reads.py``). The library is loaded once per process,
    at the import of ``protection/checksum.py``, before any caller could pass a path down."""
    from ...env import isal_library

    explicit = isal_library()
    if explicit:
        yield explicit
    found = ctypes.util.find_library("isal")
    if found:
        yield found
    yield "libisal.so.2"
    spec = importlib.util.find_spec("pyeclib")  # locates the package without importing it
    for loc in (spec.submodule_search_locations or []) if spec else []:
        yield from (str(p) for p in sorted((Path(loc).parent / "pyeclib.libs").glob("libisal*.so*")))
    try:
        dist = importlib.metadata.distribution("pyeclib")
    except importlib.metadata.PackageNotFoundError:
        return
    for f in dist.files or []:
        if f.name.startswith("libisal") and ".so" in f.name:
            yield str(dist.locate_file(f))


def _declare(lib: ctypes.CDLL) -> None:
    """Give the C signatures so ctypes passes 64-bit pointers and sizes correctly."""
    vp, pvp, i = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
    lib.ec_init_tables.argtypes = [i, i, vp, vp]
    lib.ec_init_tables.restype = None
    lib.ec_encode_data.argtypes = [i, i, i, vp, pvp, pvp]
    lib.ec_encode_data.restype = None
    lib.ec_encode_data_update.argtypes = [i, i, i, i, vp, vp, pvp]
    lib.ec_encode_data_update.restype = None
    if hasattr(lib, "xor_gen"):
        lib.xor_gen.argtypes = [i, i, pvp]
        lib.xor_gen.restype = i
    if hasattr(lib, "crc64_ecma_refl"):
        lib.crc64_ecma_refl.argtypes = [ctypes.c_uint64, vp, ctypes.c_uint64]
        lib.crc64_ecma_refl.restype = ctypes.c_uint64


def load_isal() -> tuple[ctypes.CDLL | None, str]:
    """Return (library, description); library is None and description says why when absent."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _try_load()
        return _loaded


def _try_load() -> tuple[ctypes.CDLL | None, str]:
    tried: list[str] = []
    for path in dict.fromkeys(_candidates()):
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
            continue
        missing = [s for s in _REQUIRED if not hasattr(lib, s)]
        if missing:
            tried.append(f"{path}: lacks {', '.join(missing)}")
            continue
        _declare(lib)
        return lib, path
    return None, "libisal not found (tried: " + "; ".join(tried) + ")"


def _ptrs(tensors: Sequence[torch.Tensor], offset: int) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() + offset for t in tensors))


class IsalEngine(ErasureEngine):
    """Erasure engine on ISA-L. CPU, contiguous ``torch.uint8`` pages only."""

    name = "isal"

    def __init__(self) -> None:
        lib, where = load_isal()
        if lib is None:
            raise EngineUnavailableError(where)
        self._lib = lib
        self.library_path = where
        self._tables: OrderedDict[tuple[int, int, bytes], ctypes.Array] = OrderedDict()
        self._tables_lock = threading.Lock()
        self._xor_gen_ok: bool | None = None  # in-place xor_gen checked (None: not yet)

    def _gf_tables(self, matrix: np.ndarray) -> ctypes.Array:
        """Expanded multiplication tables for ``matrix``, cached (reused every step)."""
        rows, cols = matrix.shape
        key = (rows, cols, matrix.tobytes())
        with self._tables_lock:
            tbl = self._tables.get(key)
            if tbl is not None:
                self._tables.move_to_end(key)
                return tbl
        tbl = ctypes.create_string_buffer(32 * rows * cols)
        coeffs = ctypes.create_string_buffer(key[2], len(key[2]))
        self._lib.ec_init_tables(cols, rows, coeffs, tbl)
        with self._tables_lock:
            self._tables[key] = tbl
            while len(self._tables) > _TABLE_CACHE_SIZE:
                self._tables.popitem(last=False)
        return tbl

    def dot(self, matrix: np.ndarray, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
        """``dsts[j] = XOR_i matrix[j, i] * srcs[i]`` with ``ec_encode_data``."""
        length = check_operands(srcs, dsts, cpu_only=True)
        mat = check_matrix(matrix, len(dsts), len(srcs))
        if not dsts or length == 0:
            return
        if not srcs:
            for d in dsts:
                d.zero_()
            return
        tbl = self._gf_tables(mat)
        for off in range(0, length, _SLICE):
            n = min(_SLICE, length - off)
            self._lib.ec_encode_data(n, len(srcs), len(dsts), tbl, _ptrs(srcs, off), _ptrs(dsts, off))

    def mad(self, coeffs: np.ndarray, src: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """``dsts[j] ^= coeffs[j] * src`` with ``ec_encode_data_update`` (one column)."""
        length = check_operands([src], dsts, cpu_only=True)
        col = check_matrix(np.asarray(coeffs).reshape(-1, 1), len(dsts), 1)
        if not dsts or length == 0:
            return
        tbl = self._gf_tables(col)
        for off in range(0, length, _SLICE):
            n = min(_SLICE, length - off)
            self._lib.ec_encode_data_update(
                n, 1, len(dsts), 0, tbl, ctypes.c_void_p(src.data_ptr() + off), _ptrs(dsts, off)
            )

    def xor_fold(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        """``dst ^= XOR(srcs)`` in one pass with ``xor_gen`` (``dst`` is its first source and its
        destination): one read of each operand and one write, against one read-modify-write of
        ``dst`` per source for word XORs. Falls back to them off ISA-L's contract (64-byte
        aligned addresses and lengths) or if the in-place call fails its self-check."""
        length = dst.numel()
        fits = length and length % 64 == 0 and all(t.data_ptr() % 64 == 0 for t in (dst, *srcs))
        if not fits or not self._xor_gen_usable():
            super().xor_fold(dst, srcs)
            return
        for off in range(0, length, _SLICE):
            n = min(_SLICE, length - off)
            array = _ptrs([dst, *srcs, dst], off)
            if self._lib.xor_gen(len(array), n, array) != 0:
                raise EngineUnavailableError(f"ISA-L xor_gen refused {n} bytes at 64-byte aligned addresses")

    def _xor_gen_usable(self) -> bool:
        """ISA-L documents ``xor_gen`` without aliasing: check once that the in-place form (the
        destination also a source) computes what word XORs compute."""
        if self._xor_gen_ok is None:
            self._xor_gen_ok = hasattr(self._lib, "xor_gen") and _xor_gen_in_place_agrees(self._lib)
        return self._xor_gen_ok


def _xor_gen_in_place_agrees(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    for n in (64, 4096, (1 << 16) + 192):
        pages = torch.randint(0, 256, (3, n), dtype=torch.uint8, generator=gen)
        want = pages[0] ^ pages[1] ^ pages[2]
        dst = pages[0]
        if lib.xor_gen(4, n, _ptrs([dst, pages[1], pages[2], dst], 0)) != 0 or not torch.equal(dst, want):
            return False
    return True
