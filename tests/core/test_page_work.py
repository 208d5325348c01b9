"""The helper thread of chunk transactions (updater.page_work): results, errors, fork, and the
same retained bytes with and without it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from leto_lightning.retained.config import RetainedConfig
from leto_lightning.updater.page_work import PageWork
from leto_lightning.updater.retained_optimizer import RetainedOptimizer


def test_results_in_item_order_and_every_item_once():
    work = PageWork(helpers=1)
    seen: list[int] = []
    lock = threading.Lock()

    def square(x: int) -> int:
        with lock:
            seen.append(x)
        return x * x

    for n in (0, 1, 2, 37):
        assert work.run(square, list(range(n))) == [x * x for x in range(n)]
    assert sorted(seen) == sorted(x for n in (0, 1, 2, 37) for x in range(n))
    assert PageWork(helpers=0).run(square, [3, 4]) == [9, 16]


@pytest.mark.parametrize("bad", [0, 29])  # an item of this thread's, or (likely) the helper's
def test_an_item_error_reaches_the_caller(bad):
    def fail_at(x: int) -> int:
        if x == bad:
            raise ArithmeticError(f"item {x}")
        return x

    with pytest.raises(ArithmeticError, match=f"item {bad}"):
        PageWork(helpers=1).run(fail_at, list(range(30)))


def test_a_forked_child_gets_its_own_helper():
    work = PageWork(helpers=1)
    assert work.run(abs, [-1, -2]) == [1, 2]  # the parent's helper thread is running
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a new one serves it
        os._exit(0 if work.run(abs, list(range(-50, 0))) == list(range(50, 0, -1)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _train(helpers: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ro = RetainedOptimizer.create(opt, RetainedConfig(page_bytes=4096, tier1_parity=1))
    try:
        ro.txn.work = PageWork(helpers=helpers)
        for _ in range(3):
            ro.zero_grad()
            model(torch.randn(16, 64)).square().mean().backward()
            ro.step()
        return [p.detach().clone() for p in model.parameters()], ro.store.crcs.clone()
    finally:
        ro.store.unlink()
        ro.store.close()


def test_same_params_and_checksums_with_and_without_the_helper():
    params0, crcs0 = _train(helpers=0)  # checksums in the delta loop, one thread
    params1, crcs1 = _train(helpers=1)  # checksums and half the undo copy on the helper
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert torch.equal(crcs0, crcs1)


def test_the_default_helper_steps_aside_on_a_full_run_queue(monkeypatch):
    work = PageWork()  # adaptive
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (float(cpus), 0.0, 0.0))
    assert not work.active()  # every CPU already has a runnable process: all work on the caller
    assert work.run(abs, [-3, -4]) == [3, 4]
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    work._checked_at = -1.0  # the load is read at most once a second
    assert work.active() == (cpus >= 2)
    assert PageWork(helpers=1).active()  # explicit: whatever the load
