"""ReedSolomonCode: validation, encode/delta/reconstruct/verify, hypothesis properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rs_helpers import random_pages, reference_dot

from leto_lightning.protection import ParityExhaustedError, ProtectionError, ReedSolomonCode
from leto_lightning.protection.engines import available_engines, get_engine

LENGTHS = st.sampled_from([1, 2, 63, 64, 65, 255, 4096, 4097]) | st.integers(1, 3000)
PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pages(seed: int, count: int, length: int) -> list[torch.Tensor]:
    return random_pages(np.random.default_rng(seed), count, length)


@pytest.mark.parametrize(
    "k,m,match",
    [
        (0, 0, "k=0"),
        (4, -1, "m=-1"),
        (2, 3, "m=3 > k=2"),
        (200, 56, "k \\+ m = 256"),
        (True, 1, "int"),
        (4, 1.0, "int"),
    ],
)
def test_rejects_bad_parameters(k, m, match):
    with pytest.raises(ValueError, match=match):
        ReedSolomonCode(k, m)


def test_limits_accepted():
    assert ReedSolomonCode(1, 0).matrix.shape == (0, 1)
    assert ReedSolomonCode(128, 127, "torch").matrix.shape == (127, 128)
    assert not ReedSolomonCode(4, 2).matrix.flags.writeable


def test_encode_is_cauchy_dot_and_first_parity_is_xor(engine):
    code = ReedSolomonCode(6, 3, engine)
    data = _pages(1, 6, 1000)
    parity = [torch.empty(1000, dtype=torch.uint8) for _ in range(3)]
    code.encode(data, parity)
    for got, want in zip(parity, reference_dot(code.matrix, data)):
        assert np.array_equal(got.numpy(), want)
    xor = data[0].clone()
    for d in data[1:]:
        xor ^= d
    assert torch.equal(parity[0], xor)


def test_group_shape_errors():
    code = ReedSolomonCode(4, 2, "torch")
    data, parity = _pages(2, 4, 64), _pages(3, 2, 64)
    with pytest.raises(ValueError, match="1..4"):
        code.encode(data + data[:1], parity)
    with pytest.raises(ValueError, match="m=2"):
        code.encode(data, parity[:1])
    with pytest.raises(ValueError, match="out of range"):
        code.apply_contribution(4, data[0], parity)
    with pytest.raises(ValueError, match="twice"):
        code.reconstruct(data, parity, [1, 1])
    with pytest.raises(ValueError, match="outside"):
        code.reconstruct(data, parity, [], [2])
    with pytest.raises(TypeError, match="uint8"):
        code.encode([d.float() for d in data], parity)


def test_parity_exhausted_message():
    code = ReedSolomonCode(5, 2, "torch")
    data, parity = _pages(4, 5, 100), _pages(5, 2, 100)
    before = [d.clone() for d in data]
    with pytest.raises(ParityExhaustedError, match="3 lost data page.*only 2 parity") as info:
        code.reconstruct(data, parity, [0, 1, 2])
    assert isinstance(info.value, ProtectionError) and isinstance(info.value, RuntimeError)
    assert (info.value.lost, info.value.surviving_parity) == (3, 2)
    with pytest.raises(ParityExhaustedError, match="only 1 parity"):
        code.reconstruct(data, parity, [0, 1], [1])
    assert all(torch.equal(a, b) for a, b in zip(before, data))  # nothing written


def test_verify_finds_bad_parity(engine):
    code = ReedSolomonCode(4, 3, engine)
    data = _pages(6, 4, 777)
    parity = [torch.empty(777, dtype=torch.uint8) for _ in range(3)]
    code.encode(data, parity)
    assert code.verify(data, parity) == []
    parity[2][500] ^= 1
    assert code.verify(data, parity) == [2]
    data[0][0] ^= 4
    assert code.verify(data, parity) == [0, 1, 2]


def test_apply_contribution_adds_and_removes(engine):
    code = ReedSolomonCode(4, 2, engine)
    data = _pages(7, 4, 513)
    full = [torch.empty(513, dtype=torch.uint8) for _ in range(2)]
    code.encode(data, full)
    partial = [torch.empty(513, dtype=torch.uint8) for _ in range(2)]
    code.encode(data[:3], partial)  # short group: first three columns
    code.apply_contribution(3, data[3], partial)
    assert all(torch.equal(a, b) for a, b in zip(full, partial))
    code.apply_contribution(3, data[3], partial)  # applied twice: removed again
    again = [torch.empty(513, dtype=torch.uint8) for _ in range(2)]
    code.encode(data[:3], again)
    assert all(torch.equal(a, b) for a, b in zip(again, partial))


@needs_cuda
def test_auto_code_routes_cuda_pages_to_torch():
    code = ReedSolomonCode(4, 2)
    data = [p.cuda() for p in _pages(8, 4, 4097)]
    parity = [torch.empty(4097, dtype=torch.uint8, device="cuda") for _ in range(2)]
    code.encode(data, parity)
    lost = [d.clone() for d in data[1:3]]
    data[1].zero_(), data[2].fill_(3)
    code.reconstruct(data, parity, [1, 2])
    assert torch.equal(data[1], lost[0]) and torch.equal(data[2], lost[1])


# ------------------------------------------------------------------ properties
@st.composite
def groups(draw):
    k = draw(st.integers(1, 12))
    m = draw(st.integers(0, min(k, 4)))
    n = draw(st.integers(1, k))  # pages actually present (short last group)
    return k, m, n, draw(LENGTHS), draw(st.integers(0, 2**32 - 1))


@PROPS
@given(groups(), st.data(), st.sampled_from(available_engines()))
def test_reconstruct_any_erasures_within_parity(group, draw, engine_name):
    k, m, n, length, seed = group
    code = ReedSolomonCode(k, m, engine_name)
    data = _pages(seed, n, length)
    parity = [torch.empty(length, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, parity)
    original = [d.clone() for d in data] + [p.clone() for p in parity]
    lost_p = draw.draw(st.sets(st.integers(0, m - 1), max_size=m)) if m else set()
    budget = min(n, m - len(lost_p))
    lost_d = draw.draw(st.sets(st.integers(0, n - 1), max_size=budget))
    for i in lost_d:
        data[i].fill_(0xAB)  # garbage where the lost pages were
    for j in lost_p:
        parity[j].fill_(0xCD)
    code.reconstruct(data, parity, lost_d, lost_p)
    assert all(torch.equal(a, b) for a, b in zip(data + parity, original))


@PROPS
@given(groups(), st.data())
def test_too_many_erasures_raise(group, draw):
    k, m, n, length, seed = group
    lost_p = draw.draw(st.sets(st.integers(0, m - 1), max_size=m)) if m else set()
    alive = m - len(lost_p)
    if n <= alive:
        return  # every pattern on this group is repairable
    lost_d = draw.draw(st.sets(st.integers(0, n - 1), min_size=alive + 1))
    code = ReedSolomonCode(k, m, "torch")
    data, parity = _pages(seed, n, length), _pages(seed + 1, m, length)
    with pytest.raises(ParityExhaustedError):
        code.reconstruct(data, parity, lost_d, lost_p)


@PROPS
@given(groups(), st.lists(st.tuples(st.integers(0, 11), st.integers(0, 2**32 - 1)), max_size=6),
       st.sampled_from(available_engines()), st.booleans())
def test_delta_updates_equal_fresh_encode(group, updates, engine_name, with_scratch):
    k, m, n, length, seed = group
    code = ReedSolomonCode(k, m, engine_name)
    data = _pages(seed, n, length)
    parity = [torch.empty(length, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, parity)
    scratch = torch.empty(length, dtype=torch.uint8) if with_scratch else None
    for index, s in updates:
        index %= n
        new = _pages(s, 1, length)[0]
        old = data[index].clone()
        data[index].copy_(new)
        code.apply_delta(index, old, new, parity, scratch)
    fresh = [torch.empty(length, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, fresh)
    assert all(torch.equal(a, b) for a, b in zip(parity, fresh))


@PROPS
@given(groups())
def test_engines_agree_on_codes(group):
    k, m, n, length, seed = group
    data = _pages(seed, n, length)
    results = []
    for name in available_engines():
        parity = [torch.empty(length, dtype=torch.uint8) for _ in range(m)]
        ReedSolomonCode(k, m, get_engine(name)).encode(data, parity)
        results.append(parity)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("m", [1, 2, 3])
def test_apply_delta_edge_cases(engine, m):
    code = ReedSolomonCode(4, m, engine)
    data = _pages(9, 4, 300)
    parity = [torch.empty(300, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, parity)
    before = [p.clone() for p in parity]
    code.apply_delta(2, data[2], data[2], parity)  # no change: parity untouched
    assert all(torch.equal(a, b) for a, b in zip(before, parity))
    with pytest.raises(ValueError, match="bytes"):
        code.apply_delta(2, data[2], data[1], parity, torch.empty(299, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes"):
        code.apply_delta(2, data[2], data[1][:299], parity)
