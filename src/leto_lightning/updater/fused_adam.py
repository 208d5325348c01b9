"""The fused Adam chunk update: undo copy, math, tier-1 parity delta and checksums in one pass.

``ChunkTransactions`` runs an Adam/AdamW chunk as this one call (after the undo header), which
walks the chunk in blocks of 16 KiB of each buffer and, while a block is in cache, saves its
undo copy, applies torch's single-tensor Adam math to it, folds ``old ^ new`` into the XOR
parity page and extends the page's CRC-64.
Unfused, the same work is about ten passes over the chunk (torch's Adam is one pass per
operation) plus one for the delta and one for the checksum; at large sizes each pass runs at
last-level-cache speed, and the update cost 2-3x torch's own ``optimizer.step()``.

Exactness: the C kernel (``_fused_adam.c``) rounds every operation as torch's CPU kernels do
(fused multiply-adds where torch's vectorised kernels use them, ``-ffp-contract=off``
elsewhere) and takes its square root from the function torch's ``sqrt`` calls (MKL's
``vsSqrt`` in the builds that have it). Rather than trust that, the kernel is used only after it
reproduces ``torch.optim.adam.adam`` bit for bit on this machine (``_agrees_with_torch``, once
per process, a few milliseconds); otherwise, and for what it does not cover (AMSGrad, maximize,
tensor hyper-parameters, non-float32 or device pages, no compiled extension), chunks run torch's
math as before. ``LETO_FUSED_ADAM=0`` turns it off: read by runtime/ and the integrations, and
passed down as ``ProcessSettings.fused_adam`` (``ChunkTransactions(fused_adam=False)`` never
calls ``kernel``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..env import FUSED_ADAM
from ..errors import InternalError
from ..protection.checksum import crc64_address

log = logging.getLogger("leto_lightning.updater.fused_adam")

ENV_SWITCH = FUSED_ADAM  # the variable that turns the kernel off (read above: ProcessSettings.fused_adam)
HP_FIELDS = 8  # per piece: decay, l2, 1 - beta1, beta2, 1 - beta2, sqrt(bc2), eps, -step_size
_vp = ctypes.c_void_p


@dataclass(frozen=True)
class Kernel:
    """The loaded kernel and the two functions it calls back."""

    function: Any  # leto_adam_chunk (a ctypes function)
    crc: int
    sqrt: int
    encode: Any  # leto_xor_encode_crc

    def encode_xor(self, pages: Sequence[torch.Tensor], parity: torch.Tensor) -> list[int]:
        """``parity`` = the XOR of ``pages`` (host pages of one size), and the pages' CRC-64s, in
        one read of every page: ``ReedSolomonCode.encode`` with one parity page whose row is all
        ones, then ``checksum`` of each page."""
        addresses = np.array([p.data_ptr() for p in pages], dtype=np.uint64)
        crcs = np.zeros(len(pages), dtype=np.uint64)
        if self.encode(len(pages), addresses.ctypes.data, parity.data_ptr(), parity.numel(), crcs.ctypes.data,
                       self.crc) != 0:  # pragma: no cover - callers pass whole host pages
            raise InternalError(f"leto_xor_encode_crc refused {len(pages)} pages of {parity.numel()} B")
        return [int(c) for c in crcs]


@cache
def kernel() -> Kernel | None:
    """The kernel when it is usable here (checked once per process), else None."""
    loaded, why = _load()
    if loaded is None:
        log.info("fused Adam update off: %s; chunks run torch's Adam math", why)
        return None
    if not _agrees_with_torch(loaded):
        log.warning("fused Adam update off: the compiled kernel does not reproduce torch.optim.adam bit for bit "
                    "on this machine (torch %s); chunks run torch's Adam math", torch.__version__)
        return None
    return loaded


@cache
def switched_off() -> tuple[None, str]:
    """What stands for the kernel where the caller's settings turn it off (``LETO_FUSED_ADAM=0``):
    None and why, logged once per process."""
    why = f"{ENV_SWITCH}=0"
    log.info("fused Adam update off: %s; chunks run torch's Adam math", why)
    return None, why


def _load() -> tuple[Kernel | None, str]:
    spec = importlib.util.find_spec("leto_lightning.updater._fused_adam")
    if spec is None or spec.origin is None:
        return None, "the extension leto_lightning.updater._fused_adam is not built (no C compiler at install?)"
    crc = crc64_address()
    if crc is None:
        return None, "no CRC-64 kernel (ISA-L) to checksum pages with"
    lib = ctypes.CDLL(spec.origin)
    fn = lib.leto_adam_chunk
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] + [_vp] * 10 + [ctypes.c_int] + [_vp] * 4
    sqrt = _torch_sqrt() or ctypes.cast(lib.leto_sqrt_exact, _vp).value
    assert sqrt is not None
    encode = lib.leto_xor_encode_crc
    encode.restype = ctypes.c_int
    encode.argtypes = [ctypes.c_int, _vp, _vp, ctypes.c_int64, _vp, _vp]
    return Kernel(fn, crc, sqrt, encode), ""


def _torch_sqrt() -> int | None:
    """The address of the vector square root torch's CPU ``sqrt`` kernel calls (MKL's vsSqrt,
    exported by libtorch_cpu in the MKL builds), or None."""
    for lib in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            fn = ctypes.CDLL(str(lib)).vsSqrt
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, _vp).value
    return None


def covers(hp: dict) -> bool:
    """Whether the kernel computes what torch's Adam does with this param group's settings."""
    if hp.get("amsgrad") or hp.get("maximize") or hp.get("foreach"):
        return False  # foreach=True: torch runs its multi-tensor kernels, which this does not reproduce
    values = (hp["lr"], *hp["betas"], hp["eps"], hp["weight_decay"])
    return all(type(x) in (float, int) for x in values)  # a tensor lr/beta takes torch's own path


def piece_hparams(hp: dict, step: float) -> tuple[float, ...]:
    """One piece's row of kernel scalars for this step (``covers(hp)`` true), computed in double
    precision exactly as ``torch.optim.adam._single_tensor_adam`` does; numpy rounds them to
    float32 as torch rounds a Python scalar for a float32 kernel."""
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    decoupled = bool(hp.get("decoupled_weight_decay", False))
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    decay = 1 - lr * wd if decoupled and wd != 0 else 1.0
    return (decay, 0.0 if decoupled else wd, 1 - beta1, beta2, 1 - beta2, bias_correction2**0.5, eps,
            -(lr / bias_correction1))


@dataclass
class FusedChunk:
    """One chunk's arguments to the kernel, resolved once (``ChunkPlan`` keeps it)."""

    page_elems: int
    n_pages: int  # pages per kind
    pointers: tuple[int, ...]  # param, exp_avg, exp_avg_sq, grad, then their undo copies
    parity: np.ndarray | None  # uint64 addresses of each page's XOR parity page, kind-major
    pieces: np.ndarray  # int64 [n, 2] element ranges relative to the chunk

    def __post_init__(self) -> None:
        # Addresses read once: a numpy ``.ctypes`` lookup costs about a microsecond, per call.
        self._parity_at = self.parity.ctypes.data if self.parity is not None else None
        self._pieces_at = self.pieces.ctypes.data

    def run(self, k: Kernel, begin: int, end: int, rows: np.ndarray, pieces: np.ndarray | None, crcs: np.ndarray,
            progress: np.ndarray | None = None) -> None:
        """Elements ``[begin, end)`` of every kind; ``crcs`` carries the running checksums.
        ``pieces``: a subset of the chunk's pieces (params without a gradient left out), None
        for all of them; ``rows`` one row of ``piece_hparams`` per piece run. ``progress`` (one
        int64 word in retained memory): save the undo copies as it goes and count the bytes per
        kind saved there (see the C file); None: they are saved already."""
        n_pieces, at = (len(self.pieces), self._pieces_at) if pieces is None else (len(pieces), pieces.ctypes.data)
        rc = k.function(begin, end, self.page_elems, self.n_pages, *self.pointers,
                        progress.ctypes.data if progress is not None else None, self._parity_at, crcs.ctypes.data,
                        n_pieces, at, rows.ctypes.data, k.crc, k.sqrt)
        if rc != 0:  # pragma: no cover - the plan is built to the kernel's contract
            raise InternalError(f"leto_adam_chunk refused its arguments (begin={begin}, end={end})")


def build_fused_chunk(pages: Sequence[torch.Tensor], undo: Sequence[torch.Tensor], grads: torch.Tensor,
                      parity: Sequence[Sequence[torch.Tensor]] | None,
                      pieces: Sequence[tuple[int, int]]) -> FusedChunk | None:
    """The kernel's view of a chunk whose updated pages are ``pages`` (param, exp_avg,
    exp_avg_sq, in that order, contiguous per kind; their dtype is ``grads``'), or None when it
    does not apply."""
    if grads.dtype != torch.float32 or len(pages) % 3 or any(p.device.type != "cpu" for p in (*pages, *undo, grads)):
        return None
    n_pages = len(pages) // 3
    firsts = [pages[k * n_pages] for k in range(3)] + [grads] + [undo[k * n_pages] for k in range(3)]
    page_elems = pages[0].numel() // 4
    xor = None
    if parity is not None:
        if any(len(group) != 1 for group in parity):
            return None  # Reed-Solomon with H1 > 1: the kernel does math and checksums, the codec the delta
        xor = np.array([group[0].data_ptr() for group in parity], dtype=np.uint64)
    return FusedChunk(page_elems, n_pages, tuple(t.data_ptr() for t in firsts), xor,
                      np.array(pieces, dtype=np.int64).reshape(-1, 2))


def _agrees_with_torch(k: Kernel) -> bool:
    """The kernel against torch on a few random chunks: AdamW, Adam with an L2 penalty, a large
    ``1 - beta1``; several steps; pieces of odd lengths (vector bodies and scalar tails) that
    cross a page boundary and leave a tail untouched."""
    gen = torch.Generator().manual_seed(1234)
    cuts = [0, 5, 1000, 1041, 2043]
    steps = [1.0, 7.0, 1000.0, 3.0]
    return all(reproduces_torch(k, 1024, 2, cuts, {"lr": 1e-3, "betas": (beta1, 0.999), "eps": 1e-8,
                                                   "weight_decay": wd, "decoupled_weight_decay": decoupled},
                                steps, gen, shared_parity=shared)
               for decoupled, beta1, wd, shared in ((True, 0.9, 0.1, True), (False, 0.9, 0.01, False),
                                                    (True, 0.3, 0.0, True)))


def reproduces_torch(k: Kernel, page_elems: int, n_pages: int, cuts: Sequence[int], hp: dict,
                     steps: Sequence[float], gen: torch.Generator, shared_parity: bool = False) -> bool:
    """One chunk of ``n_pages`` pages per kind, pieces between consecutive ``cuts``: whether the
    kernel leaves exactly what ``torch.optim.adam.adam`` (single-tensor) computes, the undo
    copies and progress count, the XOR parity delta and the pages' checksums. ``shared_parity``:
    page ``j`` of the three kinds shares one parity page (as tier-1 groups mostly make them),
    else every page has its own."""
    from torch.optim.adam import adam as functional_adam

    from ..protection.checksum import checksum

    n = page_elems * n_pages
    pieces = list(itertools.pairwise(cuts))
    state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
             torch.rand(n, generator=gen) * 1e-4, torch.randn(n, generator=gen) * 1e-2]
    old = [t.clone() for t in state[:3]]
    beta1, beta2 = hp["betas"]
    ref = [t.clone() for t in state[:3]]
    functional_adam([ref[0][a:b] for a, b in pieces], [state[3][a:b] for a, b in pieces],
                    [ref[1][a:b] for a, b in pieces], [ref[2][a:b] for a, b in pieces], [],
                    [torch.tensor(s - 1) for s in steps], foreach=False, capturable=False, differentiable=False,
                    fused=None, grad_scale=None, found_inf=None, has_complex=False,
                    decoupled_weight_decay=bool(hp.get("decoupled_weight_decay")), amsgrad=False, beta1=beta1,
                    beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False)
    undo = [torch.zeros(n) for _ in range(3)]  # the kernel saves the undo copies itself
    distinct = [torch.randint(0, 256, (page_elems * 4,), dtype=torch.uint8, generator=gen)
                for _ in range(n_pages if shared_parity else 3 * n_pages)]
    parity = [distinct[i % n_pages] for i in range(3 * n_pages)] if shared_parity else distinct  # per page, kind-major
    expected = {id(par): par.view(torch.int32).clone() for par in distinct}
    for i, par in enumerate(parity):
        kind, j = divmod(i, n_pages)
        before, after = (t[kind].view(torch.int32).view(n_pages, -1)[j] for t in (old, ref))
        expected[id(par)] ^= before ^ after
    pages = [t.view(torch.uint8).view(n_pages, -1)[j] for t in state[:3] for j in range(n_pages)]
    undo_pages = [t.view(torch.uint8).view(n_pages, -1)[j] for t in undo for j in range(n_pages)]
    fused = build_fused_chunk(pages, undo_pages, state[3], [[p] for p in parity], pieces)
    assert fused is not None
    rows = np.array([piece_hparams(hp, s) for s in steps], dtype=np.float32).reshape(len(pieces), HP_FIELDS)
    crcs, progress = np.zeros(3 * n_pages, dtype=np.uint64), np.zeros(1, dtype=np.int64)
    fused.run(k, 0, n, rows, None, crcs, progress)
    return (int(progress[0]) == 4 * n and all(torch.equal(a, b) for a, b in zip(undo, old))
            and all(torch.equal(a, b) for a, b in zip(state[:3], ref))
            and all(torch.equal(par.view(torch.int32), expected[id(par)]) for par in distinct)
            and [int(c) for c in crcs] == [checksum(p) for p in pages])
