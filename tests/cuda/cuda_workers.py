"""Trainer-side work for tests/cuda, run in *spawned* processes (CUDA and ``fork`` do not mix).

Every worker takes ``kind``: ``"cuda"`` (device memory through CUDA IPC) or ``"cpu"`` (the
state manager's shared-memory stand-in, so the processes, protocol and lifetimes are tested on
machines without a GPU). Results go back as plain Python values -- never tensors, which
``multiprocessing`` would try to share through its own shared memory.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

import torch

from leto_lightning.env import ProcessSettings
from leto_lightning.faults.points import set_hook
from leto_lightning.retained.backends import cuda_ipc
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.store import RetainedStore
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.retained_optimizer import RetainedOptimizer

TIMEOUT = 240.0  # s per spawned worker: interpreter + torch import + CUDA context + work
CONFIG = dict(page_bytes=1024, chunk_pages=1, data_pages=4, tier1_parity=2, record_bytes=1 << 14, backend="cuda")
ADAMW = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)  # torch's default implementation (foreach on CUDA)


# -- running workers -----------------------------------------------------------------------
def spawn(target: Callable, *args: Any):
    """Start ``target(conn, *args)`` in a spawned process; returns (process, parent end)."""
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_entry, args=(target, child, *args))
    proc.start()
    child.close()
    return proc, parent


def _entry(target: Callable, conn: Connection, *args: Any) -> None:
    try:
        target(conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def receive(proc, conn: Connection, timeout: float = TIMEOUT) -> tuple[str, Any]:
    """The worker's next message; a worker error or silence fails the test (and is reaped)."""
    if not conn.poll(timeout):
        kill(proc)
        raise AssertionError(f"worker {proc.pid} sent nothing within {timeout:.0f} s")
    try:
        kind, value = conn.recv()
    except EOFError:
        proc.join(30)
        raise AssertionError(f"worker {proc.pid} exited without a result (exit code {proc.exitcode})") from None
    if kind == "error":
        proc.join(30)
        raise AssertionError(f"worker failed:\n{value}")
    return kind, value


def call(target: Callable, *args: Any) -> Any:
    """Run a worker to completion and return its result."""
    proc, conn = spawn(target, *args)
    try:
        _, value = receive(proc, conn)
        proc.join(60)
        assert proc.exitcode == 0, f"worker exit code {proc.exitcode}"
        return value
    finally:
        kill(proc)
        conn.close()


def kill(proc) -> None:
    """SIGKILL by pid (nothing in the worker gets to clean up) and reap."""
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join()


# -- the model both sides train --------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(23, 41)
        self.b = torch.nn.Linear(41, 7)
        self.low = torch.nn.Parameter(torch.randn(13, dtype=torch.bfloat16))  # a second segment

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + self.low.float().sum()


def _use(kind: str, address: str) -> str:
    """Point new stores at the test's manager (the environment, read as a runtime reads it:
    ``ProcessSettings.from_env()``); for the stand-in, let 'cuda' stores run on CPU."""
    os.environ[cuda_ipc.MANAGER_ENV] = address
    if kind == "cpu":
        cuda_ipc.require_cuda = lambda: None
        RetainedConfig.for_device = lambda self, device_type: self  # backend="cuda" on host params
        torch.cuda.current_device = lambda: "cpu"  # a private manager becomes a stand-in too
        return "cpu"
    torch.cuda.set_device(0)
    return "cuda"


def _model(device: str, **options: Any) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net().to(device)
    return model, torch.optim.AdamW(model.parameters(), **{**ADAMW, **options})


def _iterate(model: Net, opt: Any, it: int, device: str) -> None:
    x = torch.randn(9, 23, generator=torch.Generator().manual_seed(100 + it)).to(device)
    opt.zero_grad()
    model(x).square().mean().backward()
    inner = opt.optimizer if isinstance(opt, RetainedOptimizer) else opt
    inner.param_groups[0]["lr"] = ADAMW["lr"] * (0.5 if it >= 2 else 1.0)  # a schedule: lr halves at 2
    opt.step()


def snapshot(store: RetainedStore) -> dict:
    """Everything retained, as bytes: data pages (params, grads, state), parity, checksums, steps."""
    return {"data": store.data.cpu().numpy().tobytes(), "parity1": store.parity1.numpy().tobytes(),
            "crcs": store.crcs.tolist(), "steps": store.steps.tolist(), "versions": store.versions().tolist()}


# -- workers ---------------------------------------------------------------------------------
def train(conn: Connection, kind: str, address: str, job_id: str, steps: int, kill_at: tuple | None) -> None:
    """Train ``steps`` iterations; report and wait to be SIGKILLed, or stop at point ``kill_at``
    (name, occurrence) of the next iteration, report, and wait there to be killed."""
    device = _use(kind, address)
    model, opt = _model(device)
    ro = RetainedOptimizer.create(opt, RetainedConfig(**CONFIG), job_id=job_id, settings=ProcessSettings.from_env())
    assert ro.store.data.device.type == device and ro.store.parity1.device.type == "cpu"
    for it in range(steps):
        _iterate(model, ro, it, device)
    if kill_at is None:
        conn.send(("trained", snapshot(ro.store)))
    else:
        set_hook(_stop_at(conn, *kill_at))
        _iterate(model, ro, steps, device)
        conn.send(("finished", None))  # the point was never reached: the test fails
    time.sleep(3600)


def _stop_at(conn: Connection, name: str, occurrence: int) -> Callable:
    seen = 0

    def hook(point: str, context: dict) -> None:
        nonlocal seen
        if point == name:
            seen += 1
            if seen == occurrence:
                conn.send(("at", point))
                time.sleep(3600)
    return hook


def inspect(conn: Connection, kind: str, address: str, job_id: str, unlink: bool) -> None:
    """A fresh process attaches the retained store and reports it (then frees it if asked)."""
    _use(kind, address)
    store = RetainedStore.attach(job_id, 0)
    result = snapshot(store)
    result["device"] = store.data.device.type
    store.close()
    if unlink:
        store.unlink()
    conn.send(("result", result))


def recover_and_continue(conn: Connection, kind: str, address: str, job_id: str, t: int) -> None:
    """Recover a store left by a crash in iteration ``t``, then let a shadow train ``t + 1``."""
    device = _use(kind, address)
    store = RetainedStore.attach(job_id, 0)
    report = recover_node({0: store})[0]
    recovered = snapshot(store)
    model, opt = _model(device)
    ro = RetainedOptimizer(opt, store)
    ro.bind(adopt=True)
    assert ro.iteration == t + 1 == report.resume_iteration, (ro.iteration, report.summary())
    _iterate(model, ro, t + 1, device)
    continued = snapshot(store)
    store.close()
    store.unlink()
    conn.send(("result", {"recovered": recovered, "continued": continued, "summary": report.summary()}))


def reference(conn: Connection, kind: str, address: str, job_id: str, steps: int) -> None:
    """An uninterrupted run: snapshots after ``steps - 1`` and ``steps`` iterations."""
    device = _use(kind, address)
    model, opt = _model(device)
    ro = RetainedOptimizer.create(opt, RetainedConfig(**CONFIG), job_id=job_id, settings=ProcessSettings.from_env())
    shots = []
    for it in range(steps):
        _iterate(model, ro, it, device)
        shots.append(snapshot(ro.store))
    ro.store.close()
    ro.store.unlink()
    conn.send(("result", shots[-2:]))


def adamw_matches_torch(conn: Connection, kind: str, address: str, steps: int, foreach: bool | None) -> None:
    """RetainedOptimizer's chunked AdamW vs torch.optim.AdamW(foreach=...) on the same params
    (None: torch's default, the multi-tensor kernels on CUDA)."""
    device = _use(kind, address)
    ref_model, ref_opt = _model(device, foreach=foreach)
    model, opt = _model(device, foreach=foreach)
    ro = RetainedOptimizer.create(opt, RetainedConfig(**CONFIG), settings=ProcessSettings.from_env())
    for it in range(steps):
        _iterate(ref_model, ref_opt, it, device)
        _iterate(model, ro, it, device)
    diffs = [f"param {i}" for i, (a, b) in enumerate(zip(model.parameters(), ref_model.parameters()))
             if a.device != b.device or not torch.equal(a, b)]
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        mine, theirs = opt.state[p], ref_opt.state[q]
        diffs += [f"param {i} {k}" for k in theirs if not torch.equal(mine[k].cpu(), theirs[k].cpu())]
    on_device = all(p.device.type == device for p in model.parameters())
    ro.store.close()
    ro.store.unlink()
    conn.send(("result", {"diffs": diffs, "on_device": on_device}))


def private_manager(conn: Connection, kind: str) -> None:
    """No manager configured: the store starts a private one, which exits once freed."""
    device = _use(kind, "")
    del os.environ[cuda_ipc.MANAGER_ENV]
    model, opt = _model(device)
    ro = RetainedOptimizer.create(opt, RetainedConfig(**CONFIG), settings=ProcessSettings.from_env())
    address = ro.store.spec.device_manager
    manager = cuda_ipc._PRIVATE[address]
    held = sorted(cuda_ipc.CudaStateManager(address).stats()["buffers"])
    _iterate(model, ro, 0, device)
    ro.store.close()
    ro.store.unlink()
    conn.send(("result", {"held": held, "alive_after_unlink": manager.process.is_alive(),
                          "registered": address in cuda_ipc._PRIVATE}))
