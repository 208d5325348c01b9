"""Device pages with host parity (protection.staging), checked on CPU tensors.

The staging functions never look at which device a page is on beyond choosing where buffers
live, so running them on host tensors checks their arithmetic and both delta strategies
against the direct codec path. The CUDA copies themselves are exercised by tests/cuda.
"""

from __future__ import annotations

import pytest
import torch

from leto_lightning.protection import staging
from leto_lightning.protection.codec import ReedSolomonCode
from leto_lightning.protection.engines import available_engines, get_engine
from leto_lightning.protection.errors import ParityExhaustedError

N = 4096


def _pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g) for _ in range(n)]


@pytest.mark.parametrize("host", available_engines())
@pytest.mark.parametrize("m", [1, 2, 3])
def test_staged_delta_matches_direct(host, m):
    code = ReedSolomonCode(6, m, "torch")
    data = _pages(6, 1)
    direct = [torch.zeros(N, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, direct)
    staged = [p.clone() for p in direct]
    new = _pages(1, 2)[0]
    code.apply_delta(3, data[3], new, direct)
    staging.apply_delta(code, 3, data[3], new, staged, get_engine(host))
    assert staging.ships_products(m, get_engine(host)) == (m > 1 and host != "isal")
    for a, b in zip(staged, direct):
        assert torch.equal(a, b)
    data[3] = new
    fresh = [torch.zeros(N, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, fresh)
    assert all(torch.equal(a, b) for a, b in zip(staged, fresh))


@pytest.mark.parametrize("m", [1, 2])
def test_staged_encode_contribution_reconstruct_verify(m):
    code = ReedSolomonCode(5, m, "auto")
    data = _pages(4, 3)  # a short group (fewer than k pages)
    want = [torch.zeros(N, dtype=torch.uint8) for _ in range(m)]
    code.encode(data, want)
    got = [torch.full((N,), 7, dtype=torch.uint8) for _ in range(m)]
    staging.encode(code, data, got, code.engine)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert staging.verify(code, data, got) == []
    got[0][5] ^= 1
    assert staging.verify(code, data, got) == [0]
    got[0][5] ^= 1
    # contribution: remove page 2's share, then add it back
    staging.apply_contribution(code, 2, data[2], got, code.engine)
    assert not torch.equal(got[0], want[0])
    staging.apply_contribution(code, 2, data[2], got, code.engine)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    lost = list(range(m))
    originals = [data[i].clone() for i in lost]
    for i in lost:
        data[i].fill_(0xAB)
    staging.reconstruct(code, data, got, lost, [])
    assert all(torch.equal(data[i], o) for i, o in zip(lost, originals))


def test_staged_reconstruct_beyond_parity_writes_nothing():
    code = ReedSolomonCode(4, 1, "auto")
    data = _pages(4, 4)
    parity = [torch.zeros(N, dtype=torch.uint8)]
    code.encode(data, parity)
    before = [p.clone() for p in data]
    with pytest.raises(ParityExhaustedError):
        staging.reconstruct(code, data, parity, [0, 1], [])
    assert all(torch.equal(a, b) for a, b in zip(data, before))


def test_staging_rejects_bad_operands():
    code = ReedSolomonCode(4, 2, "auto")
    data = _pages(2, 5)
    short = [torch.zeros(N // 2, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="bytes"):
        staging.apply_delta(code, 0, data[0], data[1], short, code.engine)
    with pytest.raises(ValueError, match="parity pages"):
        staging.apply_delta(code, 0, data[0], data[1], short[:1], code.engine)
    with pytest.raises(TypeError):
        staging.encode(code, [data[0].view(torch.int32)], [torch.zeros(N, dtype=torch.uint8)] * 2, code.engine)
    assert not staging.crosses(data, short)  # all on one device: the direct path
    assert not staging.crosses(data, [])  # no parity: nothing to stage


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_codec_routes_device_pages_to_staging():
    """On a GPU: device data with host parity through the public codec API equals host math."""
    code = ReedSolomonCode(4, 2, "auto")
    host = _pages(4, 6)
    dev = [p.cuda() for p in host]
    want = [torch.zeros(N, dtype=torch.uint8) for _ in range(2)]
    code.encode(host, want)
    got = [torch.zeros(N, dtype=torch.uint8) for _ in range(2)]
    code.encode(dev, got)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    new = _pages(1, 7)[0]
    code.apply_delta(1, host[1], new, want)
    code.apply_delta(1, dev[1], new.cuda(), got)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    dev[1] = new.cuda()
    dev[0].zero_()
    code.reconstruct(dev, got, [0])
    assert torch.equal(dev[0].cpu(), host[0])
    assert code.verify(dev, got) == []
