"""Page checksums: known check values, algorithm naming, zero-copy views."""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch

from leto_lightning.protection import CHECKSUM_ALGORITHM, checksum, checksum_many
from leto_lightning.protection.checksum import available_algorithms

CHECK = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)


def test_active_algorithm_is_listed_first():
    assert available_algorithms()[0] == CHECKSUM_ALGORITHM
    assert "crc32-zlib" in available_algorithms()


@pytest.mark.skipif("crc64-ecma-refl" not in available_algorithms(), reason="libisal not loadable")
def test_crc64_check_value():
    assert checksum(CHECK, "crc64-ecma-refl") == 0x995DC9BBDF1939FA  # CRC-64/XZ check value


def test_crc32_matches_zlib():
    assert checksum(CHECK, "crc32-zlib") == zlib.crc32(b"123456789")


def test_detects_single_bit_flip_and_views():
    page = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    base = checksum(page)
    page[12345] ^= 0x10
    assert checksum(page) != base
    big = torch.zeros(3 * 4096, dtype=torch.uint8)
    assert checksum(big[4096:8192]) == checksum(torch.zeros(4096, dtype=torch.uint8))
    assert checksum(torch.empty(0, dtype=torch.uint8)) == 0


def test_other_dtypes_are_checksummed_as_bytes():
    x = torch.arange(10, dtype=torch.float32)
    assert checksum(x) == checksum(x.view(torch.uint8))
    assert checksum_many([x, CHECK]) == [checksum(x), checksum(CHECK)]


def test_rejects_bad_input():
    with pytest.raises(TypeError, match="contiguous"):
        checksum(torch.zeros(10, dtype=torch.uint8)[::2])
    with pytest.raises(TypeError):
        checksum(b"bytes")
    with pytest.raises(ValueError, match="not available"):
        checksum(CHECK, "md5")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pages_checksum_like_host():
    page = torch.randint(0, 256, (4097,), dtype=torch.uint8)
    assert checksum(page.cuda()) == checksum(page)


@pytest.mark.skipif("crc64-ecma-refl" not in available_algorithms(), reason="libisal not loadable")
def test_selected_crc64_kernel_equals_isal_dispatch():
    """The kernel chosen for speed computes the same CRC as ISA-L's dispatched function (recorded
    checksums stay comparable across machines), at every length and alignment tried."""
    module = importlib.import_module("leto_lightning.protection.checksum")
    dispatched = module._lib.crc64_ecma_refl
    page = torch.randint(0, 256, ((1 << 20) + 77,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for start, n in [(0, 1 << 20), (5, 1 << 20), (1, 4095), (0, 129), (0, 1)]:
        ptr = page.data_ptr() + start
        assert module._crc64(0, ptr, n) == dispatched(0, ptr, n)
        assert checksum(page[start : start + n]) == dispatched(0, ptr, n)
