"""GF(2^8) arithmetic and small-matrix algebra for Reed-Solomon parity.

The field uses the polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11d), the same as ISA-L,
reedsolo, zfec and Jerasure, so parity computed by any engine here can be checked
against those libraries byte for byte.

Only *small* objects live here (coefficient matrices of at most 255 x 255); bulk page
arithmetic belongs to the engines (``protection/engines``). Matrices are ``numpy``
``uint8`` arrays: row ``j`` of a parity matrix holds the coefficients of parity page
``j``.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigurationError
from .errors import NoInverseError

POLYNOMIAL = 0x11D
"""The field's reduction polynomial (ISA-L / reedsolo convention)."""

FIELD_SIZE = 256
MAX_CODE_LENGTH = 255
"""Largest k + m supported (every data and parity page needs its own field point)."""


class SingularMatrixError(ConfigurationError):
    """A square GF(2^8) matrix has no inverse."""


def _build_tables() -> tuple[np.ndarray, np.ndarray]:
    """Return (exp, log): exp has 512 entries so exp[log a + log b] needs no modulo."""
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLYNOMIAL
    exp[255:510] = exp[:255]
    return exp, log


EXP, LOG = _build_tables()
# log(0) is undefined; LOG[0] stays 0 and every caller masks zero operands explicitly.


def _build_mul_table() -> np.ndarray:
    """Full 256 x 256 product table (64 KiB): fast vectorized small-matrix products."""
    a = np.arange(256)
    prod = EXP[(LOG[a][:, None] + LOG[a][None, :])]
    prod[0, :] = 0
    prod[:, 0] = 0
    return prod.astype(np.uint8)


MUL_TABLE = _build_mul_table()


def mul(a: int, b: int) -> int:
    """Product of two field elements."""
    return int(MUL_TABLE[a, b])


def inv(a: int) -> int:
    """Multiplicative inverse; 0 has none (NoInverseError, a ZeroDivisionError)."""
    if not 0 < a < 256:
        raise NoInverseError(f"GF(2^8) element {a} has no inverse (must be 1..255)")
    return int(EXP[255 - LOG[a]])


def div(a: int, b: int) -> int:
    """a / b in the field."""
    return mul(a, inv(b))


def pow_(a: int, n: int) -> int:
    """a ** n in the field (n >= 0; 0 ** 0 == 1)."""
    if n == 0:
        return 1
    if a == 0:
        return 0
    return int(EXP[(int(LOG[a]) * n) % 255])


def _as_matrix(a: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise ConfigurationError(f"{name} must be a 2-D matrix, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ConfigurationError(f"{name} has entries outside 0..255")
        arr = arr.astype(np.uint8)
    return arr


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8): (r x n) @ (n x c) -> (r x c) uint8."""
    a = _as_matrix(a, "a")
    b = _as_matrix(b, "b")
    if a.shape[1] != b.shape[0]:
        raise ConfigurationError(f"cannot multiply {a.shape} by {b.shape}: inner sizes differ")
    if a.shape[1] == 0:
        return np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    products = MUL_TABLE[a[:, :, None], b[None, :, :]]  # (r, n, c)
    return np.bitwise_xor.reduce(products, axis=1).astype(np.uint8)


def invert(a: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix by Gauss-Jordan elimination over GF(2^8).

    Raises SingularMatrixError when the matrix is singular, which for a parity
    sub-matrix means the code is not MDS for that erasure pattern.
    """
    a = _as_matrix(a, "matrix")
    n = a.shape[0]
    if a.shape != (n, n):
        raise ConfigurationError(f"only square matrices have inverses, got shape {a.shape}")
    work = np.concatenate([a.copy(), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        pivots = np.nonzero(work[col:, col])[0]
        if pivots.size == 0:
            raise SingularMatrixError(f"{n}x{n} matrix is singular (column {col})")
        p = col + int(pivots[0])
        if p != col:
            work[[col, p]] = work[[p, col]]
        work[col] = MUL_TABLE[inv(int(work[col, col])), work[col]]
        factors = work[:, col].copy()
        factors[col] = 0
        # Row r ^= factors[r] * pivot_row for every other row, in one vectorized step.
        work ^= MUL_TABLE[factors[:, None], work[col][None, :]]
    return np.ascontiguousarray(work[:, n:])


def cauchy_matrix(k: int, m: int) -> np.ndarray:
    """Systematic Cauchy parity matrix (m x k) whose first row is all ones.

    Entry (i, j) is ``1 / (x_i + y_j)`` with ``x_i = k + i`` and ``y_j = j`` (all
    distinct field points, as in ISA-L's ``gf_gen_cauchy1_matrix``), then each column
    is divided by its row-0 entry. Every square sub-matrix of a Cauchy matrix is
    invertible, and scaling columns by non-zero constants keeps it so; hence the code
    ``[I; C]`` is MDS, and so is any subset of its rows or columns (a short group using
    only its first columns, a code using only its first parity rows). Row 0 being all
    ones makes parity 0 the plain XOR of the data: single-loss repair at memory speed.
    """
    if k < 1 or m < 0:
        raise ConfigurationError(f"need k >= 1 and m >= 0, got k={k}, m={m}")
    if k + m > MAX_CODE_LENGTH:
        raise ConfigurationError(f"k + m = {k + m} exceeds {MAX_CODE_LENGTH} (GF(2^8) has 255 usable points)")
    if m == 0:
        return np.zeros((0, k), dtype=np.uint8)
    x = np.arange(k, k + m)[:, None]
    y = np.arange(k)[None, :]
    sums = x ^ y  # addition in GF(2^8) is XOR; never 0 since the points are distinct
    c = EXP[(255 - LOG[sums]) % 255].astype(np.uint8)  # elementwise inverse
    col_scale = EXP[(255 - LOG[c[0]]) % 255].astype(np.uint8)  # 1 / c[0, j]
    return MUL_TABLE[c, col_scale[None, :]].astype(np.uint8)


def is_mds_parity(matrix: np.ndarray) -> bool:
    """True when every square sub-matrix is invertible (exhaustive: small matrices only)."""
    from itertools import combinations

    m, k = matrix.shape
    for size in range(1, min(m, k) + 1):
        for rows in combinations(range(m), size):
            for cols in combinations(range(k), size):
                try:
                    invert(matrix[np.ix_(rows, cols)])
                except SingularMatrixError:
                    return False
    return True
