"""Systematic Reed-Solomon code over pages: encode, delta update, reconstruct, verify.

The generator is ``[I; C]`` with ``C = cauchy_matrix(k, m)`` (first row all ones, so
parity 0 is the XOR of the data). Data pages are stored as they are; ``m`` parity pages
are ``P_j = XOR_i C[j, i] * D_i``. Because parity is linear, changing page ``i`` from
``old`` to ``new`` only needs ``P_j ^= C[j, i] * (old ^ new)`` -- the undo buffer
already holds ``old``, so a delta costs no extra read of the data (docs/design.md 2.2).

A group may hold fewer than ``k`` data pages (the short last group of a device): it
uses the first ``len(data)`` columns, which is still an MDS code.

Data pages on a device with parity pages in host memory (the CUDA backend) go through
``staging``: deltas and encodes run where the data is, and one page per delta (or the parity
pages of an encode) crosses PCIe; recovery's reconstruct copies the group to the host instead.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

import numpy as np
import torch

from ..errors import ConfigurationError
from .engines import ErasureEngine, get_engine
from .engines.base import check_pages
from .errors import ParityExhaustedError
from .gf256 import MAX_CODE_LENGTH, cauchy_matrix, invert, matmul
from .staging import apply_contribution as staged_contribution
from .staging import apply_delta as staged_delta
from .staging import crosses
from .staging import encode as staged_encode
from .staging import reconstruct as staged_reconstruct
from .staging import verify as staged_verify


def decode_matrix(parity_matrix: np.ndarray, lost: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """Coefficients rebuilding data pages ``lost`` from [surviving data..., parity ``rows``...].

    For any systematic code with parity matrix ``G`` (m x n): with ``A = G[rows, lost]``
    and ``B = G[rows, alive]``, parity gives ``P = A x_lost + B x_alive``, so
    ``x_lost = A^-1 B x_alive + A^-1 P`` (minus is XOR): one dot product over all
    survivors. Raises gf256.SingularMatrixError if ``A`` is singular (not MDS).
    """
    gone = set(lost)
    alive = [i for i in range(parity_matrix.shape[1]) if i not in gone]
    a_inv = invert(parity_matrix[np.ix_(rows, lost)])
    return np.concatenate([matmul(a_inv, parity_matrix[np.ix_(rows, alive)]), a_inv], axis=1)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigurationError(f"{name} must be an int, got {value!r}")
    return int(value)


class ReedSolomonCode:
    """A systematic (k + m, k) Reed-Solomon code on equal-length byte pages."""

    def __init__(self, k: int, m: int, engine: ErasureEngine | str = "auto") -> None:
        """``k`` data pages per group, ``m`` parity pages; ``engine`` name or instance.

        With ``engine="auto"`` host pages use ISA-L when available and device (CUDA)
        pages always use the torch engine, since ISA-L cannot read device memory.
        """
        k, m = _check_int("k (data pages per group)", k), _check_int("m (parity pages)", m)
        if k < 1:
            raise ConfigurationError(f"k={k}: a group needs at least one data page")
        if m < 0:
            raise ConfigurationError(f"m={m}: the number of parity pages cannot be negative")
        if m > k:
            raise ConfigurationError(f"m={m} > k={k}: more parity than data pages is rejected (H > D); "
                                     "replicate instead")
        if k + m > MAX_CODE_LENGTH:
            raise ConfigurationError(
                f"k + m = {k + m} > {MAX_CODE_LENGTH}: GF(2^8) Reed-Solomon supports at most 255 pages"
            )
        self.k, self.m = k, m
        self._matrix = cauchy_matrix(k, m)
        self._matrix.setflags(write=False)
        self._auto = engine == "auto"
        self.engine = get_engine(engine) if isinstance(engine, str) else engine
        self._local = threading.local()

    @property
    def matrix(self) -> np.ndarray:
        """The m x k parity coefficient matrix (read-only)."""
        return self._matrix

    def __repr__(self) -> str:
        return f"ReedSolomonCode(k={self.k}, m={self.m}, engine={self.engine.name!r})"

    # ----------------------------------------------------------------- helpers
    def _engine_for(self, page: torch.Tensor) -> ErasureEngine:
        if self._auto and page.device.type != "cpu":
            return get_engine("torch")
        return self.engine

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A per-thread reusable buffer as long as ``like`` (avoids a fresh allocation per call)."""
        buf = getattr(self._local, "buf", None)
        n = like.numel()
        if buf is None or buf.device != like.device or buf.numel() < n:
            buf = self._local.buf = torch.empty(max(n, 1), dtype=torch.uint8, device=like.device)
        return buf[:n]

    def _check_counts(self, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> None:
        if not 1 <= len(data) <= self.k:
            raise ConfigurationError(f"got {len(data)} data pages; this code takes 1..{self.k}")
        if len(parity) != self.m:
            raise ConfigurationError(f"got {len(parity)} parity pages; this code has m={self.m}")

    def _check_group(self, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> int:
        self._check_counts(data, parity)
        length = check_pages([*data, *parity], what="group pages")
        return length

    def _check_index(self, index: int, n: int = 0) -> int:
        index = _check_int("index", index)
        if not 0 <= index < (n or self.k):
            raise ConfigurationError(f"data page index {index} out of range 0..{(n or self.k) - 1}")
        return index

    # ----------------------------------------------------------------- encode
    def encode(self, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> None:
        """Overwrite ``parity`` with the parity of ``data`` (1..k pages)."""
        if crosses(data, parity):
            self._check_counts(data, parity)
            staged_encode(self, data, parity, self.engine)
            return
        self._check_group(data, parity)
        if self.m:
            self._engine_for(data[0]).dot(self._matrix[:, : len(data)], data, parity)

    def apply_contribution(self, index: int, src: torch.Tensor, parity: Sequence[torch.Tensor]) -> None:
        """``parity_j ^= g[j, index] * src``: add (or, applied again, remove) a page's share."""
        index = self._check_index(index)
        if len(parity) != self.m:
            raise ConfigurationError(f"got {len(parity)} parity pages; this code has m={self.m}")
        if crosses([src], parity):
            staged_contribution(self, index, src, parity, self.engine)
        elif self.m:
            self._engine_for(src).mad(self._matrix[:, index], src, parity)

    def apply_delta(
        self,
        index: int,
        old: torch.Tensor,
        new: torch.Tensor,
        parity: Sequence[torch.Tensor],
        scratch: torch.Tensor | None = None,
    ) -> None:
        """Fold the change of data page ``index`` from ``old`` to ``new`` into ``parity``.

        For m >= 2 computes ``delta = old ^ new`` into ``scratch`` (or a reused
        per-thread buffer) and applies one multiply-accumulate; for m == 1 applies two
        in-place updates (``old`` then ``new``) and needs no scratch. Why: memory
        traffic is 4 + 2m page passes vs 2 + 4m, and torch pays its GF multiply once
        instead of twice. Measured on cache-cold 4 MiB pages, MB/s scratch vs two updates
        (docs/benchmarks/parity-engine.md): ISA-L m=1 4,005 vs 5,061, m=2 3,303 vs 3,474,
        m=4 2,507 vs 2,175; torch m=2 404 vs 214.

        Device pages with host parity take ``staging.apply_delta`` (``scratch`` unused there).
        """
        index = self._check_index(index)
        if crosses([old, new], parity):
            staged_delta(self, index, old, new, parity, self.engine)
            return
        check_pages([old, new, *parity] + ([scratch] if scratch is not None else []), what="delta pages")
        if not self.m:
            return
        engine, coeffs = self._engine_for(old), self._matrix[:, index]
        if self.m == 1 and coeffs[0] == 1:
            # The XOR row (row 0 of the generator is all ones): no GF multiply at all. ISA-L folds
            # both pages in one pass (xor_gen), torch in two word-wide XORs -- per 256 KiB page,
            # measured 8.6 us, 15 us and 41 us for the pair of ISA-L GF multiply-accumulates.
            engine.xor_fold(parity[0], (old, new))
            return
        if self.m == 1:
            engine.mad(coeffs, old, parity)
            engine.mad(coeffs, new, parity)
            return
        buf = self._scratch(old) if scratch is None else scratch.view(-1)
        torch.bitwise_xor(old.view(-1), new.view(-1), out=buf)
        engine.mad(coeffs, buf.view_as(old), parity)

    # ------------------------------------------------------------ reconstruct
    def reconstruct(
        self,
        data: Sequence[torch.Tensor],
        parity: Sequence[torch.Tensor],
        lost_data: Collection[int],
        lost_parity: Collection[int] = (),
    ) -> None:
        """Rebuild lost data pages in place from the survivors, then lost parity pages.

        Uses the first ``len(lost_data)`` surviving parity rows (row 0, the XOR row,
        first: a single loss is then a plain XOR). Raises ParityExhaustedError when more
        data pages are lost than parity pages survive; nothing is written then. Device pages
        with host parity are rebuilt on the host (``staging.reconstruct``).
        """
        if crosses(data, parity):
            self._check_counts(data, parity)
            staged_reconstruct(self, data, parity, lost_data, lost_parity)
            return
        self._check_group(data, parity)
        lost_d = self._check_positions(lost_data, len(data), "lost_data")
        lost_p = self._check_positions(lost_parity, self.m, "lost_parity")
        alive_p = [j for j in range(self.m) if j not in lost_p]
        if len(lost_d) > len(alive_p):
            raise ParityExhaustedError(
                len(lost_d), len(alive_p), f"{len(lost_p)} of {self.m} parity pages are lost too"
            )
        engine = self._engine_for(data[0])
        if lost_d:
            rows = alive_p[: len(lost_d)]
            alive_d = [i for i in range(len(data)) if i not in lost_d]
            decode = decode_matrix(self._matrix[:, : len(data)], lost_d, rows)
            srcs = [data[i] for i in alive_d] + [parity[j] for j in rows]
            engine.dot(decode, srcs, [data[i] for i in lost_d])
        if lost_p:
            engine.dot(self._matrix[np.ix_(lost_p, range(len(data)))], data, [parity[j] for j in lost_p])

    @staticmethod
    def _check_positions(positions: Collection[int], n: int, name: str) -> list[int]:
        out = sorted({_check_int(name, p) for p in positions})
        if len(out) != len(list(positions)):
            raise ConfigurationError(f"{name} lists a page twice: {sorted(positions)}")
        if out and not (out[0] >= 0 and out[-1] < n):
            raise ConfigurationError(f"{name}={out} has positions outside 0..{n - 1}")
        return out

    # ----------------------------------------------------------------- verify
    def verify(self, data: Sequence[torch.Tensor], parity: Sequence[torch.Tensor]) -> list[int]:
        """Indices of parity pages that differ from a fresh encode of ``data``."""
        if crosses(data, parity):
            self._check_counts(data, parity)
            return staged_verify(self, data, parity)
        self._check_group(data, parity)
        engine = self._engine_for(data[0])
        scratch = self._scratch(data[0]).view_as(data[0])
        bad = []
        for j in range(self.m):
            engine.dot(self._matrix[j : j + 1, : len(data)], data, [scratch])
            if not torch.equal(scratch, parity[j]):
                bad.append(j)
        return bad

