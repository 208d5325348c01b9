"""GF(2^8) field and matrix algebra, and the Cauchy generator's MDS property."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from leto_lightning.protection import gf256


def test_tables_match_polynomial_0x11d():
    assert gf256.mul(0x80, 2) == 0x1D  # x^8 = x^4 + x^3 + x^2 + 1
    assert gf256.EXP[255] == 1 and len(set(gf256.EXP[:255].tolist())) == 255


def test_mul_table_is_a_field():
    t = gf256.MUL_TABLE.astype(int)
    assert (t == t.T).all()
    assert (t[1] == np.arange(256)).all() and (t[0] == 0).all()
    for a in range(1, 256):
        assert gf256.mul(a, gf256.inv(a)) == 1
    a, b, c = np.random.default_rng(0).integers(0, 256, (3, 2000))
    assert (t[a, t[b, c]] == t[t[a, b], c]).all()  # associative
    assert (t[a, b ^ c] == t[a, b] ^ t[a, c]).all()  # distributive over XOR


def test_inv_of_zero_raises():
    with pytest.raises(ZeroDivisionError):
        gf256.inv(0)


def test_pow_and_div():
    assert gf256.pow_(2, 8) == 0x1D and gf256.pow_(0, 0) == 1 and gf256.pow_(0, 3) == 0
    assert gf256.div(gf256.mul(7, 9), 9) == 7


def test_invert_roundtrip_and_singular():
    rng = np.random.default_rng(1)
    for n in (1, 2, 5, 16):
        c = gf256.cauchy_matrix(n, n)
        assert (gf256.matmul(c, gf256.invert(c)) == np.eye(n, dtype=np.uint8)).all()
    a = rng.integers(0, 256, (4, 4)).astype(np.uint8)
    a[3] = a[1]
    with pytest.raises(gf256.SingularMatrixError):
        gf256.invert(a)
    with pytest.raises(ValueError):
        gf256.invert(np.zeros((2, 3), dtype=np.uint8))


def test_matmul_shapes():
    with pytest.raises(ValueError):
        gf256.matmul(np.zeros((2, 3), np.uint8), np.zeros((2, 3), np.uint8))
    assert gf256.matmul(np.zeros((2, 0), np.uint8), np.zeros((0, 3), np.uint8)).shape == (2, 3)


def test_cauchy_first_row_is_xor():
    for k, m in [(1, 1), (8, 2), (16, 4), (128, 127), (251, 4)]:
        c = gf256.cauchy_matrix(k, m)
        assert c.shape == (m, k) and c.dtype == np.uint8
        assert (c[0] == 1).all()
        assert (c != 0).all()
    assert gf256.cauchy_matrix(5, 0).shape == (0, 5)


def test_cauchy_limits():
    with pytest.raises(ValueError, match="255"):
        gf256.cauchy_matrix(200, 56)
    with pytest.raises(ValueError):
        gf256.cauchy_matrix(0, 1)


@pytest.mark.parametrize("k", range(1, 9))
def test_cauchy_mds_exhaustive_small(k):
    for m in range(0, 5):
        assert gf256.is_mds_parity(gf256.cauchy_matrix(k, m)), (k, m)


@pytest.mark.parametrize("k,m", [(16, 4), (12, 4), (64, 8), (251, 4), (128, 127)])
def test_cauchy_mds_sampled(k, m):
    rng = np.random.default_rng(k * 1000 + m)
    c = gf256.cauchy_matrix(k, m)
    for _ in range(60):
        size = int(rng.integers(1, m + 1))
        rows = rng.choice(m, size, replace=False)
        cols = rng.choice(k, size, replace=False)
        gf256.invert(c[np.ix_(rows, cols)])  # raises if singular


def test_short_group_prefix_columns_are_mds():
    c = gf256.cauchy_matrix(12, 3)
    for n in range(1, 7):
        assert gf256.is_mds_parity(c[:, :n])
    # a full square check over the widest prefix, every row subset
    for rows in itertools.combinations(range(3), 3):
        for cols in itertools.combinations(range(12), 3):
            gf256.invert(c[np.ix_(rows, cols)])


def test_is_mds_parity_detects_bad_matrices():
    c = gf256.cauchy_matrix(8, 4).copy()
    c[2, 3] = 0  # a zero 1x1 sub-matrix
    assert not gf256.is_mds_parity(c)
    c = gf256.cauchy_matrix(8, 4).copy()
    c[1, :2], c[2, :2] = 5, 7  # rank-1 2x2 block
    assert not gf256.is_mds_parity(c)
