"""Erasure engines: exact agreement with a numpy reference and with reedsolo."""

from __future__ import annotations

import numpy as np
import pytest
import reedsolo
import torch
from rs_helpers import random_pages, reference_dot

from leto_lightning.protection import gf256
from leto_lightning.protection.engines import (
    IsalEngine,
    TorchEngine,
    available_engines,
    get_engine,
)
from leto_lightning.protection.errors import EngineUnavailableError

# reedsolo's own coefficient matrix for 8 data + 2 parity symbols (notes/erasure-coding.md)
REEDSOLO_8_2 = np.array(
    [[226, 255, 127, 63, 31, 15, 7, 3], [227, 254, 126, 62, 30, 14, 6, 2]], dtype=np.uint8
)
ODD_LENGTHS = [1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 4095, 4097, 65537]
needs_isal = pytest.mark.skipif("isal" not in available_engines(), reason="libisal not loadable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("length", ODD_LENGTHS)
def test_dot_matches_reference(engine, length):
    rng = np.random.default_rng(length)
    k, r = 7, 5
    matrix = rng.integers(0, 256, (r, k), dtype=np.uint8)
    matrix[0, 2] = 0
    srcs = random_pages(rng, k, length)
    dsts = random_pages(rng, r, length)  # garbage: dot must overwrite
    engine.dot(matrix, srcs, dsts)
    for got, want in zip(dsts, reference_dot(matrix, srcs)):
        assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("length", ODD_LENGTHS)
def test_mad_matches_reference(engine, length):
    rng = np.random.default_rng(length + 1)
    coeffs = np.array([1, 0, 2, 255, 142, 7, 99], dtype=np.uint8)
    src = random_pages(rng, 1, length)[0]
    dsts = random_pages(rng, len(coeffs), length)
    want = [d.numpy() ^ gf256.MUL_TABLE[c][src.numpy()] for c, d in zip(coeffs, dsts)]
    engine.mad(coeffs, src, dsts)
    for got, w in zip(dsts, want):
        assert np.array_equal(got.numpy(), w)


def test_engines_agree_bit_for_bit():
    if len(available_engines()) < 2:
        pytest.skip("only one engine available")
    rng = np.random.default_rng(7)
    matrix = gf256.cauchy_matrix(12, 4)
    srcs = random_pages(rng, 12, 300_001)
    out = {}
    for name in available_engines():
        dsts = [torch.empty(300_001, dtype=torch.uint8) for _ in range(4)]
        get_engine(name).dot(matrix, srcs, dsts)
        out[name] = dsts
    for a, b in zip(*out.values()):
        assert torch.equal(a, b)


def _reedsolo_columns(pages: list[torch.Tensor]) -> list[bytearray]:
    """reedsolo encodes each byte column (byte j of every page) as one 8+2 codeword."""
    rs = reedsolo.RSCodec(2)
    stacked = np.stack([p.numpy() for p in pages], axis=1)  # (length, 8)
    return [rs.encode(bytearray(col.tobytes())) for col in stacked]


@pytest.mark.parametrize("length", [1, 63, 257])
def test_dot_reproduces_reedsolo_parity(engine, length):
    rng = np.random.default_rng(11)
    pages = random_pages(rng, 8, length)
    parity = [torch.empty(length, dtype=torch.uint8) for _ in range(2)]
    engine.dot(REEDSOLO_8_2, pages, parity)
    words = _reedsolo_columns(pages)
    ecc = np.array([list(w[8:]) for w in words], dtype=np.uint8)  # (length, 2)
    assert np.array_equal(ecc[:, 0], parity[0].numpy())
    assert np.array_equal(ecc[:, 1], parity[1].numpy())


def test_reedsolo_decodes_engine_parity(engine):
    """reedsolo repairs two erasures in codewords whose parity our engine computed."""
    rng = np.random.default_rng(12)
    length = 97
    pages = random_pages(rng, 8, length)
    parity = [torch.empty(length, dtype=torch.uint8) for _ in range(2)]
    engine.dot(REEDSOLO_8_2, pages, parity)
    rs = reedsolo.RSCodec(2)
    for j in range(length):
        word = bytearray([int(p[j]) for p in pages] + [int(q[j]) for q in parity])
        want = bytes(word[:8])
        word[2] ^= 0x5A
        word[6] = 0
        decoded = rs.decode(word, erase_pos=[2, 6])[0]
        assert bytes(decoded) == want


def test_engine_decodes_reedsolo_codewords(engine):
    """Our decode-matrix construction repairs codewords that reedsolo encoded."""
    from leto_lightning.protection.codec import decode_matrix

    rng = np.random.default_rng(13)
    length = 129
    pages = random_pages(rng, 8, length)
    words = np.array([list(w) for w in _reedsolo_columns(pages)], dtype=np.uint8)  # (length, 10)
    lost = [1, 5]
    alive = [i for i in range(8) if i not in lost]
    srcs = [torch.from_numpy(words[:, i].copy()) for i in alive + [8, 9]]
    rebuilt = [torch.zeros(length, dtype=torch.uint8) for _ in lost]
    engine.dot(decode_matrix(REEDSOLO_8_2, lost, [0, 1]), srcs, rebuilt)
    for i, page in zip(lost, rebuilt):
        assert torch.equal(page, pages[i])


def test_xor_into(engine):
    a = torch.arange(100, dtype=torch.uint8)
    b = torch.full((100,), 0xFF, dtype=torch.uint8)
    engine.xor_into(a, b)
    assert torch.equal(a, 0xFF - torch.arange(100, dtype=torch.uint8))


@pytest.mark.parametrize("length,start", [(1 << 16, 0), (4096, 8), (4096, 3), (100, 0), (1 << 20, 64)])
def test_xor_fold_in_place(engine, length, start):
    """dst ^= a ^ b: one in-place ISA-L pass on aligned pages, word or byte XORs elsewhere."""
    gen = torch.Generator().manual_seed(length + start)
    buf = torch.randint(0, 256, (3, length + 128), dtype=torch.uint8, generator=gen)
    dst, a, b = (row[start : start + length] for row in buf)
    want, original = dst ^ a ^ b, dst.clone()
    outside = torch.cat([buf[0, :start], buf[0, start + length :]])
    engine.xor_fold(dst, (a, b))
    assert torch.equal(dst, want)
    assert torch.equal(torch.cat([buf[0, :start], buf[0, start + length :]]), outside)  # only the page written
    engine.xor_fold(dst, (a, b))  # applied twice: back where it started
    assert torch.equal(dst, original)


@needs_isal
def test_isal_xor_gen_in_place_self_check():
    engine = IsalEngine()
    assert engine._xor_gen_usable()  # the in-place form agrees on this machine's library


def test_zero_sources_and_rows(engine):
    dsts = [torch.full((10,), 9, dtype=torch.uint8)]
    engine.dot(np.zeros((1, 0), dtype=np.uint8), [], dsts)
    assert int(dsts[0].sum()) == 0
    engine.dot(np.zeros((0, 2), dtype=np.uint8), [torch.ones(10, dtype=torch.uint8)] * 2, [])
    engine.dot(np.zeros((1, 1), dtype=np.uint8), [torch.ones(10, dtype=torch.uint8)], dsts)
    assert int(dsts[0].sum()) == 0


def test_rejects_bad_pages(engine):
    good = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(TypeError, match="uint8"):
        engine.dot(np.ones((1, 1), np.uint8), [torch.zeros(64, dtype=torch.int32)], [good])
    with pytest.raises(TypeError, match="contiguous"):
        engine.dot(np.ones((1, 1), np.uint8), [torch.zeros(128, dtype=torch.uint8)[::2]], [good])
    with pytest.raises(ValueError, match="bytes"):
        engine.dot(np.ones((1, 1), np.uint8), [torch.zeros(65, dtype=torch.uint8)], [good])
    with pytest.raises(ValueError, match="shape"):
        engine.dot(np.ones((2, 1), np.uint8), [torch.zeros(64, dtype=torch.uint8)], [good])
    with pytest.raises(ValueError, match="overlaps"):
        engine.mad(np.ones(1, np.uint8), good[:32], [good[16:48]])
    with pytest.raises(ValueError, match="0..255"):
        engine.mad(np.array([300]), good[:32], [good[32:]])


@needs_isal
def test_isal_rejects_device_tensors():
    eng = get_engine("isal")
    meta = torch.empty(64, dtype=torch.uint8, device="meta")
    with pytest.raises(TypeError, match="CPU"):
        eng.mad(np.ones(1, np.uint8), meta, [torch.zeros(64, dtype=torch.uint8, device="meta")])


@needs_isal
def test_isal_table_cache_reuses_tables():
    eng = IsalEngine()
    m = gf256.cauchy_matrix(4, 2)
    assert eng._gf_tables(m) is eng._gf_tables(m.copy())


def test_get_engine_names():
    assert get_engine("torch") is get_engine("torch")
    assert isinstance(get_engine("torch"), TorchEngine)
    assert get_engine("auto").name == available_engines()[0]
    with pytest.raises(ValueError, match="unknown erasure engine"):
        get_engine("fast")


def test_missing_isal_is_reported(monkeypatch, caplog):
    from leto_lightning.protection import engines

    monkeypatch.setattr(engines, "load_isal", lambda: (None, "libisal not found (tried: nowhere)"))
    monkeypatch.setattr(engines, "_warned", False)
    monkeypatch.setattr(engines, "_ENGINES", {})
    assert engines.available_engines() == ["torch"]
    with caplog.at_level("WARNING"):
        assert engines.get_engine("auto").name == "torch"
        engines.get_engine("auto")
    warnings = [r for r in caplog.records if "ISA-L" in r.getMessage()]
    assert len(warnings) == 1 and "pip install pyeclib" in warnings[0].getMessage()
    with pytest.raises(EngineUnavailableError, match="libisal2"):
        engines.get_engine("isal")


def test_torch_engine_small_blocks_match():
    rng = np.random.default_rng(3)
    srcs = random_pages(rng, 5, 10_007)
    m = gf256.cauchy_matrix(5, 3)
    a = [torch.empty(10_007, dtype=torch.uint8) for _ in range(3)]
    b = [torch.empty(10_007, dtype=torch.uint8) for _ in range(3)]
    TorchEngine(block_bytes=1000).dot(m, srcs, a)
    TorchEngine().dot(m, srcs, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@needs_cuda
def test_torch_engine_on_cuda_matches_cpu():
    rng = np.random.default_rng(4)
    srcs = random_pages(rng, 8, 1 << 20)
    m = gf256.cauchy_matrix(8, 3)
    host = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(3)]
    get_engine("torch").dot(m, srcs, host)
    dev = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    get_engine("torch").dot(m, [s.cuda() for s in srcs], dev)
    assert all(torch.equal(h, d.cpu()) for h, d in zip(host, dev))
    delta = [d.clone() for d in dev]
    get_engine("torch").mad(m[:, 2], srcs[2].cuda(), delta)
    get_engine("torch").mad(m[:, 2], srcs[2].cuda(), delta)
    assert all(torch.equal(a, b) for a, b in zip(delta, dev))
