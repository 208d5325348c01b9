"""The fused Adam chunk update (``updater.fused_adam``): the same bits as torch's Adam and as the
unfused transaction, and crash consistency of the undo copy it saves block by block (SIGKILL at
the injection points and at random times, with the one-page XOR tier 1 it folds itself)."""

from __future__ import annotations

import os
import platform
import random
import shutil
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto_lightning.env import ProcessSettings
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.testing.scenario import CoreScenario
from leto_lightning.updater import fused_adam
from leto_lightning.updater.retained_optimizer import RetainedOptimizer

from .crash_cases import MAX_T, run_case, run_time_case, step_points, step_seconds

torch.set_num_threads(1)

KERNEL = fused_adam.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the fused Adam kernel is not usable here (see its log line)")


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("cc")),
                    reason="the kernel is only required where it was built and checked: Linux x86-64 with a compiler")
def test_the_kernel_is_built_and_used_here():
    """Where the project is developed and tested the fast path must be on, or every test below
    would skip and the suite would silently test only the unfused path."""
    if os.environ.get(fused_adam.ENV_SWITCH, "1") == "0":
        pytest.skip(f"{fused_adam.ENV_SWITCH}=0")
    assert KERNEL is not None, fused_adam._load()[1] or "the kernel disagrees with torch.optim.adam on this machine"


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(page_elems=st.sampled_from([16, 48, 1024, 1040, 4096, 9232]), n_pages=st.integers(1, 3),
       n_cuts=st.integers(0, 6), seed=st.integers(0, 2**31 - 1), lr=st.floats(1e-5, 0.5),
       beta1=st.sampled_from([0.0, 0.3, 0.5, 0.8, 0.9, 0.99]), beta2=st.sampled_from([0.9, 0.95, 0.999, 0.9999]),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]), wd=st.sampled_from([0.0, 0.01, 0.1, 1.5]), decoupled=st.booleans(),
       shared=st.booleans())
def test_kernel_reproduces_torch_adam(page_elems, n_pages, n_cuts, seed, lr, beta1, beta2, eps, wd, decoupled, shared):
    rng = random.Random(seed)
    n = page_elems * n_pages
    cuts = sorted({0, rng.randrange(n // 2, n + 1), *(rng.randrange(n) for _ in range(n_cuts))})
    if len(cuts) < 2:
        cuts = [0, n]
    steps = [float(rng.choice([1, 2, 3, 10, 999, 2**20])) for _ in cuts[1:]]
    hp = {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": wd, "decoupled_weight_decay": decoupled}
    assert KERNEL is not None and fused_adam.reproduces_torch(KERNEL, page_elems, n_pages, cuts, hp, steps,
                                                              torch.Generator().manual_seed(seed), shared_parity=shared)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(29, 300)
        self.b = torch.nn.Linear(300, 5)
        self.unused = torch.nn.Linear(3, 3)  # no gradient: a skipped piece

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(cls, kwargs: dict, config: RetainedConfig, steps: int = 5) -> RetainedOptimizer:
    torch.manual_seed(0)
    model = Net()
    ro = RetainedOptimizer.create(cls(model.parameters(), **kwargs), config)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ro.zero_grad()
        model(torch.randn(7, 29, generator=g)).square().mean().backward()
        ro.step()
    return ro


@needs_kernel
@pytest.mark.parametrize("tier1_parity", [0, 1, 2])
@pytest.mark.parametrize("cls, kwargs", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                         (torch.optim.Adam, dict(lr=1e-2, betas=(0.3, 0.9), weight_decay=0.05))])
def test_transaction_bytes_equal_unfused(monkeypatch, cls, kwargs, tier1_parity):
    """Every retained byte -- data, tier-1 parity, checksums, step counters -- is what the unfused
    transaction (torch's math, the codec's delta, a checksum pass) leaves."""
    config = RetainedConfig(page_bytes=4096, chunk_pages=2, data_pages=4, tier1_parity=tier1_parity)
    fused = _train(cls, kwargs, config)
    try:
        assert all(plan.fused is not None for plan in fused.txn._plans.values())
        monkeypatch.setattr(fused_adam, "kernel", lambda: None)
        plain = _train(cls, kwargs, config)
        for name in ("data", "parity1"):
            assert torch.equal(fused.store.segments[name].tensor, plain.store.segments[name].tensor), name
        assert torch.equal(fused.store.crcs, plain.store.crcs) and torch.equal(fused.store.steps, plain.store.steps)
    finally:
        for ro in (fused, *([plain] if "plain" in locals() else [])):
            ro.store.close()
            ro.store.unlink()


def test_switch_turns_it_off(monkeypatch):
    """``LETO_FUSED_ADAM=0`` is read where the environment is read (``ProcessSettings``, by
    runtime/ and the integrations) and passed down: no chunk asks for the kernel then."""
    monkeypatch.setenv(fused_adam.ENV_SWITCH, "0")
    off = ProcessSettings.from_env()
    assert not off.fused_adam
    assert fused_adam.switched_off() == (None, "LETO_FUSED_ADAM=0")
    monkeypatch.setattr(fused_adam, "kernel", lambda: pytest.fail("LETO_FUSED_ADAM=0, yet the kernel was asked for"))
    torch.manual_seed(0)
    model = Net()
    config = RetainedConfig(page_bytes=4096, chunk_pages=2, data_pages=4, tier1_parity=1)
    ro = RetainedOptimizer.create(torch.optim.AdamW(model.parameters(), lr=1e-2), config, settings=off)
    try:
        model(torch.randn(7, 29)).square().mean().backward()
        ro.step()
        assert ro.iteration == 1
    finally:
        ro.store.close()
        ro.store.unlink()


XOR_TIER1 = RetainedConfig(page_bytes=4096, chunk_pages=2, data_pages=4, tier1_parity=1, tier2_parity=1,
                           record_bytes=1 << 16)


@pytest.fixture(scope="module")
def xor_scenario():
    sc = CoreScenario(optimizer="adamw", config=XOR_TIER1)
    return sc, sc.reference(MAX_T + 1)


@needs_kernel
def test_sigkill_at_points_with_the_kernel_folding_parity(xor_scenario):
    """Injection points, among them ``chunk.tier1_partial`` between the kernel's two calls (half
    a page saved and updated, parity half folded): recovery restores the saved bytes only."""
    scenario, reference = xor_scenario
    points = step_points(scenario)
    assert {"chunk.tier1_partial", "chunk.math_done", "chunk.undo_copied"} <= {p.name for p in points}
    failures = [(seed, r) for seed in range(24) if not (r := run_case(scenario, reference, points, seed)).ok]
    assert not failures, f"{len(failures)} cases not bit-identical; first: {failures[0]}"


@needs_kernel
def test_sigkill_at_random_times_inside_the_kernel(xor_scenario):
    scenario, reference = xor_scenario
    duration = step_seconds(scenario)
    results = [run_time_case(scenario, reference, duration, seed, max_t=2) for seed in range(24)]
    bad = [details for ok, _, details in results if not ok]
    assert not bad, f"{len(bad)} of {len(results)} cases not bit-identical; first: {bad[0]}"
    assert sum(killed for _, killed, _ in results) >= 12, "too few cases really killed a rank"


@needs_kernel
def test_undo_contract_holds_under_sigkill_at_random_times():
    """The kernel's own contract, over a chunk of many save batches (16 MiB per kind, 64 blocks
    a batch): killed at any moment, every byte before the count in ``progress`` is in the undo
    copy and every byte at or past it is untouched -- so restoring the counted bytes gives the
    old chunk back exactly. Real shared memory, forked children SIGKILLed from the parent."""
    import signal
    import time

    import numpy as np

    assert KERNEL is not None
    n_pages, page_elems = 4, 1 << 20  # 4 MiB pages
    n = n_pages * page_elems
    gen = torch.Generator().manual_seed(7)
    old = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    grads = torch.randn(n, generator=gen).share_memory_()
    state = [t.clone().share_memory_() for t in old]
    undo = [torch.empty(n).share_memory_() for _ in range(3)]
    progress = torch.zeros(1, dtype=torch.int64).share_memory_()
    pages = [t.view(torch.uint8).view(n_pages, -1)[j] for t in state for j in range(n_pages)]
    undo_pages = [t.view(torch.uint8).view(n_pages, -1)[j] for t in undo for j in range(n_pages)]
    fused = fused_adam.build_fused_chunk(pages, undo_pages, grads, None, [(0, n)])
    assert fused is not None
    hp = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
    rows = np.array([fused_adam.piece_hparams(hp, 3.0)], dtype=np.float32)

    def reset() -> None:
        for t, o, u in zip(state, old, undo):
            t.copy_(o)
            u.fill_(float("nan"))
        progress.zero_()

    def run() -> None:
        fused.run(KERNEL, 0, n, rows, None, np.zeros(3 * n_pages, dtype=np.uint64), progress.numpy())

    reset()
    start = time.perf_counter()
    run()
    duration = time.perf_counter() - start
    rng = random.Random(11)
    outcomes = []
    for _ in range(30):
        reset()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            run()
            os._exit(0)
        time.sleep(rng.uniform(0.0, 1.2 * duration))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        saved = int(progress[0]) // 4  # elements per kind
        assert 0 <= saved <= n
        for t, o, u in zip(state, old, undo):
            assert torch.equal(u[:saved], o[:saved]), "a counted byte is missing from the undo copy"
            assert torch.equal(t[saved:], o[saved:]), "a byte past the count was modified"
        outcomes.append((os.WIFSIGNALED(status), saved))
    mid = [saved for killed, saved in outcomes if killed and 0 < saved < n]
    assert len(mid) >= 10, f"too few kills inside the pass: {outcomes}"
