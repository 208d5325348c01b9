"""CUDA backend of retained memory: device buffers owned by a state-manager process and
opened by trainers through CUDA IPC handles (docs/design.md section 2.1, docs/cuda-backend.md).

Why a separate process: device memory is freed when the process that allocated it dies. If a
trainer allocated its own parameters, a crashed trainer would take them along. The
``CudaStateManager`` process allocates every retained device buffer and does nothing else, so
a trainer can die (SIGKILL, Xid 13, an NCCL abort...) and a shadow trainer maps the very same
bytes again.

**Lifetime rule.** A buffer lives exactly as long as the manager holds it: until ``free(name)``
or until the manager process exits (the driver then releases all it allocated). Nothing a
trainer does -- attach, close, crash -- allocates or frees retained device memory. Free a buffer
only once no trainer uses it any more (closed or dead): a consumer still mapping it would read
memory the manager's allocator may hand out again.

Making and opening a handle mirrors ``torch.multiprocessing.reductions``:

* manager: ``storage._share_cuda_()`` returns ``(device, handle, size_bytes, offset_bytes,
  ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)``. It also puts
  the storage behind torch's IPC reference counter (a slot in a shared-memory file, set to 1:
  "one consumer will release it"; a freed storage whose count is still > 0 is parked in torch's
  limbo and never freed) and records an interprocess event after the zero fill. The manager
  gives that count back at once (``_release_ipc_counter_cuda``): its own reference is what keeps
  the buffer alive, and a SIGKILLed trainer never decrements, so counting consumers would park
  freed buffers forever. Consumers that release decrement the slot below zero, which torch
  treats like zero (limbo keeps only counts > 0).
* trainer: ``UntypedStorage._new_shared_cuda(*that_tuple)`` makes the current stream wait on the
  event, maps the allocation (``cudaIpcOpenMemHandle``, cached per process by the caching
  allocator, so attaching a buffer twice reuses one mapping) and returns a non-resizable
  storage; the mapping closes with the last view.

The manager process itself is ``cuda_server``; what both sides share (the errors, the CUDA
check, a device's UUID) is ``cuda_device``. Tests without a GPU:
``CudaStateManager.start(device="cpu")`` runs the same process, protocol and lifetime with POSIX
shared-memory buffers standing in for device memory.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Client, Connection
from typing import Any

import torch

from ...env import CUDA_MANAGER
from ...errors import (
    ConfigurationError,
    CudaUnavailableError,
    DeviceManagerError,
    InternalError,
    UsageError,
)
from ..shm import SharedSegment
from ..torch_internals import cuda_lazy_init, open_shared_cuda, uint8_tensor
from .cuda_device import gpu_uuid, require_cuda

MANAGER_ENV = CUDA_MANAGER  # names the agent's manager; read by runtime/ and integrations: ProcessSettings
REQUEST_TIMEOUT = 300.0  # s: a multi-GiB allocation and its zero fill are not instant
_SOCKET_MAX = 100  # AF_UNIX paths are limited to 107 bytes


def default_address(tag: str, directory: str | None = None) -> str:
    """A Unix-socket path for a manager, in ``directory`` (the run directory,
    ``ProcessSettings.manager_dir``), else the temp directory."""
    name = f"leto-{tag}-statemgr.sock"
    path = os.path.join(directory or tempfile.gettempdir(), name)
    return path if len(path) <= _SOCKET_MAX else os.path.join("/tmp", name)


# -- client side -------------------------------------------------------------------------
_ERRORS = {"FileExistsError": FileExistsError, "FileNotFoundError": FileNotFoundError,
           "CudaUnavailableError": CudaUnavailableError, "ConfigurationError": ConfigurationError,
           "ValueError": ConfigurationError, "InternalError": InternalError}  # else DeviceManagerError


CONNECT_WAIT = 120.0  # s a trainer waits for its agent's manager, launched beside it, to listen


def _request(address: str, *request: Any, connect_wait: float = 0.0) -> dict:
    """One request/reply exchange with the manager at ``address``; ``connect_wait``: how long a
    manager that is still starting (no socket yet) is waited for."""
    deadline = time.monotonic() + connect_wait
    while True:
        try:
            conn = Client(address, family="AF_UNIX")
            break
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise DeviceManagerError(
                f"no state manager at {address} ({type(exc).__name__}): it was never started or it has exited, "
                "and the device memory it owned went with it"
            ) from exc
    with conn:
        conn.send(request)
        if not conn.poll(REQUEST_TIMEOUT):
            raise DeviceManagerError(f"state manager at {address} did not answer {request[0]!r} "
                                     f"within {REQUEST_TIMEOUT:.0f} s")
        try:
            reply = conn.recv()
        except EOFError as exc:
            raise DeviceManagerError(f"state manager at {address} hung up during {request[0]!r} (died?)") from exc
    if not reply.get("ok"):
        raise _ERRORS.get(reply.get("error"), DeviceManagerError)(reply.get("message", "request failed"))
    return reply


class CudaStateManager:
    """Handle on a state-manager process: it allocates retained device buffers, keeps them
    alive and serves their IPC handles. ``start`` launches one; the constructor just connects."""

    def __init__(self, address: str, process: Any = None) -> None:
        self.address = address
        self.process = process  # set in the process that started it (which then reaps it)
        self._ready_pipe: Connection | None = None

    @classmethod
    def start(cls, address: str | None = None, device: int | str = 0, *, exit_when_empty: bool = False,
              daemon: bool = False, timeout: float = 180.0, wait: bool = True) -> CudaStateManager:
        """Launch a manager in a fresh interpreter (``spawn``: CUDA and ``fork`` do not mix) and
        wait until it listens. ``device``: a CUDA index, ``"cpu"`` for the shared-memory stand-in,
        or ``"lazy"``: CUDA is initialised at the first allocation, on the device the request
        names (an agent's manager, started before it knows whether the job uses a GPU).

        ``daemon=True`` ties the manager to this process's *normal* exit (multiprocessing
        terminates daemonic children then); a SIGKILL of this process leaves it running, which is
        the point. ``exit_when_empty``: exit once the last buffer is freed (private managers).
        ``wait=False``: return at once; clients wait for the socket (``_request``'s
        ``connect_wait``) and ``ready()`` collects the start-up verdict.
        """
        if device not in ("cpu", "lazy"):
            require_cuda()
            device = int(device)
        address = address or default_address(f"{os.getpid()}-{secrets.token_hex(4)}")
        ctx = get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        from .cuda_server import serve  # the manager's side of the protocol

        proc = ctx.Process(target=serve, args=(address, device, exit_when_empty, writer),
                           name="leto-state-manager", daemon=daemon)
        proc.start()
        writer.close()
        manager = cls(address, proc)
        manager._ready_pipe = reader
        if wait:
            manager.ready(timeout)
        return manager

    def ready(self, timeout: float = 180.0) -> None:
        """Wait for the start-up verdict of a manager this process launched; raise why it failed."""
        reader = self._ready_pipe
        if reader is None:
            return
        try:
            status, detail = _wait_ready(reader, self.process, timeout)
        finally:
            reader.close()
            self._ready_pipe = None
        if status != "ready":
            self.process.join(10)
            error = CudaUnavailableError if status == "no-cuda" else DeviceManagerError
            raise error(f"state manager did not start: {detail}")

    def alloc(self, name: str, nbytes: int, device: int | None = None) -> dict:
        """Allocate a zero-filled buffer (on ``device``, else the manager's); returns its share
        (what a trainer needs to open it)."""
        return _request(self.address, "alloc", name, int(nbytes), device)["share"]

    def lookup(self, name: str) -> dict:
        return _request(self.address, "lookup", name)["share"]

    def free(self, name: str) -> bool:
        """Release a buffer (False if there was none); mind the module's lifetime rule."""
        reply = _request(self.address, "free", name)
        if reply.get("exiting"):
            self._reap()
        return bool(reply["freed"])

    def stats(self) -> dict:
        """pid, device, ``buffers`` (name -> bytes), device bytes ``allocated`` and ``reserved``."""
        return _request(self.address, "stats")

    def shutdown(self, timeout: float = 60.0) -> None:
        """Free every buffer and stop the manager (a no-op when it is gone already)."""
        try:
            _request(self.address, "shutdown")
        except DeviceManagerError:
            pass
        self._reap(timeout)

    def _reap(self, timeout: float = 60.0) -> None:
        """Join the manager process if this process started it: leave no zombie behind."""
        private = _PRIVATE.pop(self.address, None)
        proc = self.process or (private.process if private is not None else None)
        if proc is None:
            return
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()


_PRIVATE: dict[str, CudaStateManager] = {}  # managers started for single stores by this process


def manager_for_new_store(tag: str, address: str = "", directory: str | None = None) -> str:
    """Address a new CUDA store allocates from: ``address`` when given (the agent's manager,
    ``ProcessSettings.cuda_manager``), else a private manager started now on this process's
    current device, listening in ``directory`` (daemonic; it exits once its last buffer is freed)."""
    if address:
        return address
    manager = CudaStateManager.start(default_address(tag, directory), torch.cuda.current_device(),
                                     exit_when_empty=True, daemon=True)
    _PRIVATE[manager.address] = manager
    return manager.address


def stop_private(address: str) -> None:
    """Stop a private manager this process started (a store whose creation failed)."""
    manager = _PRIVATE.get(address)
    if manager is not None:
        manager.shutdown()


# -- opening a buffer in a trainer -------------------------------------------------------
def uint8_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``storage``, built the way ``rebuild_cuda_tensor`` does."""
    return uint8_tensor(storage, nbytes)


def open_cuda_share(share: dict) -> torch.Tensor:
    """Map a manager's device buffer into this process (see the module docstring)."""
    require_cuda()
    ipc = tuple(share["ipc"])
    device = int(ipc[0])
    cuda_lazy_init()
    uuid = share.get("uuid", "")
    if device >= torch.cuda.device_count() or (uuid and gpu_uuid(device) not in ("", uuid)):
        raise DeviceManagerError(
            f"the state manager's cuda:{device} (GPU {uuid or '?'}) is not this process's cuda:{device}: "
            "trainer and state manager must see the same devices (the same CUDA_VISIBLE_DEVICES)"
        )
    storage = open_shared_cuda(ipc)
    return uint8_view(storage, int(ipc[2]))


@dataclass
class CudaSegment:
    """A retained device buffer as a trainer sees it: the interface of ``SharedSegment``."""

    name: str
    nbytes: int
    address: str  # the manager that owns the buffer
    owner: bool = False
    _tensor: torch.Tensor | None = field(default=None, repr=False)
    _host: SharedSegment | None = field(default=None, repr=False)  # the CPU stand-in's mapping

    @classmethod
    def create(cls, name: str, nbytes: int, manager_address: str, device: int | None = None) -> CudaSegment:
        """Have the manager allocate a zero-filled buffer (on CUDA ``device``, else the manager's
        own), and map it here."""
        if nbytes <= 0:
            raise ConfigurationError(f"segment {name!r}: size must be positive, got {nbytes}")
        manager = CudaStateManager(manager_address)
        share = _request(manager_address, "alloc", name, int(nbytes), device, connect_wait=CONNECT_WAIT)["share"]
        try:
            return cls._open(name, manager_address, share, owner=True)
        except BaseException:
            manager.free(name)
            raise

    @classmethod
    def attach(cls, name: str, manager_address: str) -> CudaSegment:
        """Map an existing buffer (e.g. from a shadow trainer after the active one died)."""
        share = CudaStateManager(manager_address).lookup(name)
        return cls._open(name, manager_address, share, owner=False)

    @classmethod
    def _open(cls, name: str, address: str, share: dict, owner: bool) -> CudaSegment:
        if share["kind"] == "cuda":
            return cls(name, share["nbytes"], address, owner, _tensor=open_cuda_share(share))
        host = SharedSegment.attach(share["name"])
        return cls(name, share["nbytes"], address, owner, _tensor=host.tensor, _host=host)

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a writable uint8 tensor on its device (a view, no copy)."""
        if self._tensor is None:
            raise UsageError(f"segment {self.name!r} is closed")
        return self._tensor

    def close(self) -> None:
        """Drop this process's view; the buffer stays in the manager. Views still held keep the
        mapping until they are collected (as with ``SharedSegment``)."""
        self._tensor = None
        if self._host is not None:
            self._host.close()
            self._host = None

    def unlink(self) -> bool:
        """Have the manager free the buffer; False when it (or the manager) is already gone."""
        try:
            return CudaStateManager(self.address).free(self.name)
        except DeviceManagerError:
            return False


def register_host(tensor: torch.Tensor) -> bool:
    """Page-lock host memory this process maps (a parity segment) for DMA copies from the device;
    False when CUDA refuses (the copies then go through a pageable bounce buffer: slower, same
    bytes). Undo it with ``unregister_host`` before the mapping goes away."""
    if tensor.numel() == 0 or not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    except (AttributeError, RuntimeError, TypeError):  # a torch without the binding: pageable copies
        return False
    return int(err) == 0


def unregister_host(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _wait_ready(reader: Connection, proc: Any, timeout: float) -> tuple[str, str]:
    """The manager's start-up verdict: ("ready", pid), or why not (it never hangs the caller)."""
    if reader.poll(timeout):
        try:
            return reader.recv()
        except EOFError:
            proc.join(10)
            return "died", f"it exited during start-up (exit code {proc.exitcode})"
    proc.kill()
    proc.join()
    return "timeout", f"not listening after {timeout:.0f} s"
