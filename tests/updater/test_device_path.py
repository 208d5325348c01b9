"""The device update path, run on the CPU: what a CUDA store does, minus the device.

Stores whose pages live on a GPU checksum them with ``mul64-i32`` and re-encode tier-1 parity
with tensor operations where the pages are (``protection.device``, ``updater.device_pages``).
That logic does not depend on the device, so ``RetainedConfig(page_checksum="mul64-i32")`` runs it
on host pages here: the hash against an independent numpy reference, the batched XOR against the
codec, and the whole transaction protocol -- SIGKILL at random points, recovery in a fresh
process, bit-identical to plain ``torch.optim`` -- on that path. What only a GPU run shows
(``tests/cuda``, ``benchmarks/gpu_check.py``): CUDA's kernels give the same bits, pinned copies,
IPC memory, and a SIGKILLed process's queued kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leto_lightning.protection.checksum import checksum, page_checksums
from leto_lightning.protection.codec import ReedSolomonCode
from leto_lightning.protection.device import HASH_ALGORITHM, page_hashes, xor_groups, xor_pages
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.testing.scenario import CoreScenario

from .crash_cases import MAX_T, run_case, step_points

torch.set_num_threads(1)

DEVICE_PATH = dict(page_bytes=4096, chunk_pages=2, data_pages=4, tier2_parity=1, record_bytes=1 << 16,
                   page_checksum=HASH_ALGORITHM)


def _numpy_hash(page: torch.Tensor) -> int:
    """``sum(w_i * x_i) mod 2**64`` with numpy's wrapping uint64 arithmetic: the definition."""
    words = page.numpy().view(np.int32).astype(np.int64).view(np.uint64)
    i = np.arange(1, words.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        w = (z ^ (z >> np.uint64(31))) | np.uint64(1)
        return int(np.sum(words * w, dtype=np.uint64))


def test_page_hash_matches_its_definition_and_sees_every_word():
    g = torch.Generator().manual_seed(3)
    pages = torch.randint(0, 256, (5, 4096), dtype=torch.uint8, generator=g)
    got = [int(v) & ((1 << 64) - 1) for v in page_hashes(pages)]
    assert got == [_numpy_hash(p) for p in pages]
    assert page_checksums(pages) == [checksum(p) for p in pages] != got  # host pages: CRC-64 by default
    assert [checksum(p, HASH_ALGORITHM) for p in pages] == got
    page = pages[0].clone()
    base = _numpy_hash(page)
    for byte in (0, 3, 2047, 4095):  # a flipped top bit of a word and a low bit: both seen
        for bit in (0x01, 0x80):
            page[byte] ^= bit
            assert _numpy_hash(page) != base and int(page_hashes(page.view(1, -1))[0]) & ((1 << 64) - 1) != base
            page[byte] ^= bit
    swapped = page.view(torch.int32).clone()
    swapped[[1, 2]] = swapped[[2, 1]]
    if not torch.equal(swapped[1], swapped[2]):
        assert _numpy_hash(swapped.view(torch.uint8)) != base


def test_xor_groups_is_the_codecs_parity():
    g = torch.Generator().manual_seed(4)
    pages = torch.randint(0, 256, (20, 512), dtype=torch.uint8, generator=g)
    index = torch.tensor([[0, 5, 7, 9], [1, 2, 3, 19], [4, 4, 8, 11]])
    out = torch.empty(3, 512, dtype=torch.uint8)
    xor_groups(pages, index, out)
    code = ReedSolomonCode(4, 1, "torch")
    for row, members in zip(out, index.tolist()):
        parity = [torch.empty(512, dtype=torch.uint8)]
        code.encode([pages[p] for p in members], parity)
        assert torch.equal(row, parity[0])
    short = torch.empty(512, dtype=torch.uint8)
    xor_pages([pages[0], pages[5]], short)
    assert torch.equal(short, pages[0] ^ pages[5])


@pytest.mark.parametrize("optimizer,tier1", [("adamw", 1), ("sgd_nesterov", 1), ("nadam_whole", 1), ("adamw", 2)])
def test_device_path_survives_sigkills_bit_identical(optimizer, tier1):
    """The transaction protocol on the device path: SIGKILL at random points of random ranks,
    recovery in a fresh process, one more iteration, equal to plain torch.optim. H1 = 2 takes the
    codec's encode instead of the batched XOR."""
    scenario = CoreScenario(optimizer=optimizer, config=RetainedConfig(tier1_parity=tier1, **DEVICE_PATH))
    job = scenario.create_job()
    try:
        assert job.trainers[0][1].txn.device_pages is not None  # the path under test, not the host one
    finally:
        job.close()
    reference, points = scenario.reference(MAX_T + 1), step_points(scenario)
    results = [run_case(scenario, reference, points, seed) for seed in range(12)]
    bad = [(seed, r) for seed, r in enumerate(results) if not r.ok]
    assert not bad, f"{len(bad)} of {len(results)} not bit-identical; first: {bad[0]}"


@pytest.mark.parametrize("optimizer,tier1", [("adamw", 1), ("adam_amsgrad", 1), ("rmsprop_whole", 1), ("adamw", 2)])
def test_device_path_keeps_parity_and_checksums_exact(optimizer, tier1):
    """After fault-free steps every tier-1 group's host parity is the encode of its pages and every
    recorded checksum is the page's hash (recovery would re-encode stale parity silently, so it is
    checked here directly), and the state equals plain torch.optim's."""
    scenario = CoreScenario(optimizer=optimizer, config=RetainedConfig(tier1_parity=tier1, **DEVICE_PATH))
    reference = scenario.reference(3)
    job = scenario.create_job()
    try:
        job.run(3)
        for rank, store in enumerate(job.stores):
            code = ReedSolomonCode(store.config.data_pages, tier1, "torch")
            for g, members in enumerate(store.spec.tier1.groups):
                assert code.verify([store.pages[p] for p in members], list(store.parity1[g])) == [], f"group {g}"
            hashes = [int(v) for v in page_hashes(store.pages)]
            assert hashes == store.crcs.tolist()
            from leto_lightning.testing.scenario import differences
            assert not differences(job.state(rank), reference[rank][3])
    finally:
        job.close()
