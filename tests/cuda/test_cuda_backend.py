"""The CUDA backend: a state-manager process owns retained device memory, trainers open it
through CUDA IPC handles, and the memory outlives a SIGKILLed trainer.

Each process test runs twice: ``cuda`` (skipped without a CUDA device) and ``cpu``, where the
manager's shared-memory stand-in replaces device memory -- the same processes, protocol,
lifetimes, store wiring and recovery, on any machine. All trainers are *spawned* processes,
killed by pid with SIGKILL; this process never initialises CUDA.
"""

from __future__ import annotations

import os
import secrets

import cuda_workers as w
import pytest
import torch

from leto_lightning import new_job_id
from leto_lightning.errors import CudaUnavailableError, DeviceManagerError
from leto_lightning.retained.backends import cuda_ipc
from leto_lightning.retained.backends.cuda_ipc import (
    CudaSegment,
    CudaStateManager,
    uint8_view,
)
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.updater.retained_optimizer import RetainedOptimizer

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (CUDA backend written, tested on GPU runs)")
KINDS = ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])]


@pytest.fixture
def manager(request):
    """A state manager for the test (device 0, or the stand-in), shut down and reaped after it.

    At the end every buffer must have been freed by the test and, on CUDA, the manager's
    device allocations must be back to zero.
    """
    kind = request.param
    mgr = CudaStateManager.start(cuda_ipc.default_address(f"t{os.getpid()}-{secrets.token_hex(3)}"),
                                 0 if kind == "cuda" else "cpu")
    try:
        yield kind, mgr
        stats = mgr.stats()
        assert stats["buffers"] == {}, f"buffers not freed: {stats['buffers']}"
        assert stats["allocated"] == 0, f"device memory still allocated in the manager: {stats}"
    finally:
        mgr.shutdown()
    assert not mgr.process.is_alive()


# -- configuration and errors (every machine) ------------------------------------------------
def test_backend_is_validated():
    assert RetainedConfig().backend == "auto"
    assert RetainedConfig().for_device("cuda").backend == "cuda" and RetainedConfig().for_device("cpu").backend == "cpu"
    with pytest.raises(ValueError, match="backend='cpu' but the model's parameters are on cuda"):
        RetainedConfig(backend="cpu").for_device("cuda")
    assert RetainedConfig(backend="cuda").backend == "cuda"
    with pytest.raises(ValueError, match="backend='tpu'"):
        RetainedConfig(backend="tpu")


def _cuda_store_without_cuda():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CudaUnavailableError) as info:
        RetainedOptimizer.create(opt, RetainedConfig(backend="cuda", page_bytes=256))
    message = str(info.value)
    assert "RetainedConfig(backend='cuda') needs a CUDA device" in message
    assert "RetainedConfig(backend='cpu')" in message
    return message


def test_cuda_store_without_cuda_is_a_clear_error(monkeypatch):
    """Runs everywhere: CUDA made unavailable; nothing is allocated (the leak check agrees)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(cuda_ipc.MANAGER_ENV, raising=False)
    _cuda_store_without_cuda()


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_cuda_store_on_this_cpu_only_machine():
    message = _cuda_store_without_cuda()
    assert "CUDA" in message
    with pytest.raises(CudaUnavailableError):
        CudaStateManager.start(device=0)


def test_uint8_view_writes_through_its_storage():
    storage = torch.UntypedStorage(64)
    view = uint8_view(storage, 64)
    view.fill_(7)
    assert view.dtype == torch.uint8 and view.shape == (64,)
    assert bytes(storage)[:3] == b"\x07\x07\x07"


def test_unreachable_manager_is_reported(tmp_path):
    with pytest.raises(DeviceManagerError, match="no state manager"):
        CudaSegment.attach("leto-nothing-data", str(tmp_path / "none.sock"))
    assert CudaSegment("x", 1, str(tmp_path / "none.sock")).unlink() is False


@pytest.mark.parametrize("manager", ["cpu"], indirect=True)
def test_manager_protocol(manager):
    _, mgr = manager
    name = "leto-" + new_job_id() + "-proto"
    seg = CudaSegment.create(name, 4096, mgr.address)
    try:
        seg.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        again = CudaSegment.attach(name, mgr.address)
        assert again.tensor[:4].tolist() == [1, 2, 3, 4] and again.nbytes == 4096
        assert mgr.stats()["buffers"] == {name: 4096}
        with pytest.raises(FileExistsError):
            CudaSegment.create(name, 4096, mgr.address)
        again.close()
        with pytest.raises(RuntimeError, match="closed"):
            _ = again.tensor
    finally:
        seg.close()
        assert seg.unlink() is True
    assert seg.unlink() is False
    with pytest.raises(FileNotFoundError):
        CudaSegment.attach(name, mgr.address)


# -- processes: the manager keeps what a killed trainer leaves ------------------------------
@pytest.mark.parametrize("manager", KINDS, indirect=True)
def test_memory_survives_a_sigkilled_trainer(manager):
    kind, mgr = manager
    job = new_job_id()
    proc, conn = w.spawn(w.train, kind, mgr.address, job, 3, None)
    try:
        _, trained = w.receive(proc, conn)
        held_before = mgr.stats()["buffers"]
    finally:
        w.kill(proc)  # SIGKILL: the trainer cleans up nothing
        conn.close()
    assert proc.exitcode == -9
    assert sorted(held_before) == [f"leto-{job}-r0-data", f"leto-{job}-r0-undo"]
    assert mgr.stats()["buffers"] == held_before, "the manager must keep everything after the trainer died"
    seen = w.call(w.inspect, kind, mgr.address, job, True)
    assert seen["device"] == kind
    for key in ("data", "parity1", "crcs", "steps", "versions"):
        assert seen[key] == trained[key], f"{key} differs after the trainer died"
    assert seen["versions"] == [3] * len(seen["versions"])


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("manager", KINDS, indirect=True)
def test_adamw_step_is_bit_identical_to_torch(manager, foreach):
    """torch's default AdamW (multi-tensor kernels on CUDA) and its single-tensor one: they round
    differently on CUDA, and the chunks follow whichever the optimizer is set to."""
    kind, mgr = manager
    result = w.call(w.adamw_matches_torch, kind, mgr.address, 4, foreach)
    assert result["on_device"]
    assert result["diffs"] == []


@pytest.mark.parametrize("kind", KINDS)
def test_private_manager_lives_until_freed(kind):
    result = w.call(w.private_manager, kind)
    assert result["held"] == sorted(result["held"]) and len(result["held"]) == 2
    assert not result["alive_after_unlink"] and not result["registered"]


# A crash in iteration T at each of these points, then recover_node in a fresh process:
KILL_POINTS = [("prepare.recorded", 1), ("chunk.undo_marked", 2), ("chunk.math_done", 3),
               ("chunk.tier1_partial", 4), ("chunk.checksummed", 5), ("commit.begin", 1)]
T = 2


@pytest.mark.parametrize("manager", KINDS, indirect=True)
def test_crash_mid_update_recovers_bit_identical(manager):
    kind, mgr = manager
    after_t, after_next = w.call(w.reference, kind, mgr.address, new_job_id(), T + 2)
    points = KILL_POINTS if kind == "cuda" or os.environ.get("LETO_LONG") else KILL_POINTS[1:4]
    for point in points:
        job = new_job_id()
        proc, conn = w.spawn(w.train, kind, mgr.address, job, T, point)
        try:
            message, _where = w.receive(proc, conn)
            assert message == "at", f"{point} was never reached"
        finally:
            w.kill(proc)
            conn.close()
        result = w.call(w.recover_and_continue, kind, mgr.address, job, T)
        for key in ("data", "parity1", "crcs", "steps", "versions"):
            assert result["recovered"][key] == after_t[key], f"{point}: {key} differs after recovery"
            assert result["continued"][key] == after_next[key], f"{point}: {key} differs one iteration later"
