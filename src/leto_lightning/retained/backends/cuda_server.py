"""The state-manager process of the CUDA backend: owns retained device buffers, serves them.

Started by ``cuda_ipc.CudaStateManager.start`` in a fresh interpreter; see ``cuda_ipc`` for the
protocol, the lifetime rule and how IPC handles are made. One request per connection over a
Unix socket only this user can open; requests are served one at a time (they are few: a store
allocates two buffers, an attach looks up two).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from ...errors import ConfigurationError, CudaUnavailableError, DeviceManagerError, InternalError
from ..shm import SharedSegment
from ..torch_internals import release_ipc_counter, set_cuda_allocator_settings, share_cuda
from .cuda_device import gpu_uuid, require_cuda

_IDLE_CLIENT = 30.0  # s a connected client may stay silent before the manager moves on


@dataclass
class _Buffer:
    nbytes: int
    share: dict  # what a trainer needs to open it: picklable, no tensors
    keep: Any  # the tensor (CUDA) or SharedSegment (stand-in) that keeps it alive


class _Server:
    """The manager's buffers and request handling (runs in the manager process only)."""

    def __init__(self, device: int | str, exit_when_empty: bool) -> None:
        self.device = device  # a CUDA index, "cpu" (the stand-in) or "lazy" (CUDA at the first alloc)
        self.exit_when_empty = exit_when_empty
        self.buffers: dict[str, _Buffer] = {}
        self.devices: set[int] = set()  # CUDA devices this manager allocated on
        self.running = True

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def start(self) -> None:
        """Create the CUDA context now, so a bad device fails start-up, not the first alloc. A
        manager started by an agent for a job that may never use CUDA (``"lazy"``) waits: an idle
        one then costs no device memory."""
        if not self.cuda:
            return
        require_cuda()
        conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
        if "expandable_segments:true" in conf.replace(" ", "").lower():
            # Expandable segments are shared as file descriptors fetched with pidfd_getfd, which
            # containers commonly forbid (pytorch/pytorch#165685); plain cudaMalloc segments use
            # cudaIpcMemHandle, which any process of the same user can open.
            set_cuda_allocator_settings("expandable_segments:False")
        if self.device != "lazy":
            torch.cuda.set_device(int(self.device))
            torch.cuda.init()

    def handle(self, request: tuple) -> dict:
        try:
            method = getattr(self, f"op_{request[0]}", None)
            if method is None:
                raise InternalError(f"unknown request {request[0]!r} (a client of another leto-lightning version?)")
            return {"ok": True, **method(*request[1:])}
        except Exception as exc:  # reported to the client, the manager keeps serving
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)}

    def op_alloc(self, name: str, nbytes: int, device: int | None = None) -> dict:
        # FileExistsError / FileNotFoundError (op_lookup) stay the builtins: the client raises them
        # by name (cuda_ipc._ERRORS), like shm_open does for host segments, and the stores catch them.
        if name in self.buffers:
            raise FileExistsError(f"retained buffer {name!r} already exists in the state manager")
        if nbytes <= 0:
            raise ConfigurationError(f"buffer {name!r}: size must be positive, got {nbytes}")
        buf = self._alloc_cuda(name, nbytes, device) if self.cuda else self._alloc_host(name, nbytes)
        self.buffers[name] = buf
        return {"share": buf.share}

    def _alloc_cuda(self, name: str, nbytes: int, device: int | None) -> _Buffer:
        """On ``device`` (the trainer's), else the manager's own; a lazy manager needs one."""
        index = int(self.device) if device is None and self.device != "lazy" else device
        if index is None:
            raise ConfigurationError(f"buffer {name!r}: this state manager serves any device; the request must "
                                     "name one")
        self.devices.add(int(index))
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        ipc = share_cuda(tensor)  # event recorded after the zero fill
        release_ipc_counter(ipc)  # see the module docstring
        torch.cuda.synchronize(index)
        share = {"kind": "cuda", "name": name, "nbytes": nbytes, "ipc": ipc, "uuid": gpu_uuid(index)}
        return _Buffer(nbytes, share, tensor)

    @staticmethod
    def _alloc_host(name: str, nbytes: int) -> _Buffer:
        return _Buffer(nbytes, {"kind": "shm", "name": name, "nbytes": nbytes}, SharedSegment.create(name, nbytes))

    def op_lookup(self, name: str) -> dict:
        if name not in self.buffers:
            raise FileNotFoundError(f"no retained buffer {name!r} in the state manager (never allocated, or freed)")
        return {"share": self.buffers[name].share}

    def op_free(self, name: str) -> dict:
        buf = self.buffers.pop(name, None)
        if buf is not None:
            self._release(buf)
        exiting = self.exit_when_empty and buf is not None and not self.buffers
        self.running = self.running and not exiting
        return {"freed": buf is not None, "exiting": exiting}

    def op_stats(self) -> dict:
        held = {n: b.nbytes for n, b in self.buffers.items()}
        if self.cuda:
            allocated = sum(torch.cuda.memory_allocated(d) for d in sorted(self.devices))
            reserved = sum(torch.cuda.memory_reserved(d) for d in sorted(self.devices))
        else:
            allocated = reserved = sum(held.values())
        return {"pid": os.getpid(), "device": self.device, "buffers": held, "allocated": allocated,
                "reserved": reserved}

    def op_shutdown(self) -> dict:
        self.release_all()
        self.running = False
        return {}

    def release_all(self) -> None:
        while self.buffers:
            self._release(self.buffers.popitem()[1])

    def _release(self, buf: _Buffer) -> None:
        if self.cuda:
            index = int(buf.share["ipc"][0])
            torch.cuda.synchronize(index)
            buf.keep = None  # the last reference: the caching allocator gets the block back
            with torch.cuda.device(index):
                torch.cuda.ipc_collect()
                torch.cuda.empty_cache()  # and the driver gets the memory back
        else:
            buf.keep.close()
            buf.keep.unlink()


def _listen(address: str) -> Listener:
    """Listen on a Unix socket only this user can use; replace a killed manager's socket."""
    if os.path.exists(address):
        try:
            Client(address, family="AF_UNIX").close()
        except ConnectionRefusedError:
            os.unlink(address)
        else:
            raise DeviceManagerError(f"a state manager is already listening at {address}")
    old = os.umask(0o077)
    try:
        return Listener(address, family="AF_UNIX")
    finally:
        os.umask(old)


def serve(address: str, device: int | str, exit_when_empty: bool, ready: Connection) -> None:
    """The manager process: own the buffers and answer requests until shut down."""
    try:
        os.setsid()  # its own session: a signal aimed at the trainers' process group spares it
    except OSError:
        pass
    server = _Server(device, exit_when_empty)
    try:
        server.start()
        listener = _listen(address)
    except CudaUnavailableError as exc:
        ready.send(("no-cuda", str(exc)))
        return
    except Exception as exc:  # any start-up failure goes to the starter, which raises DeviceManagerError
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    ready.send(("ready", str(os.getpid())))
    ready.close()
    try:
        with listener:
            while server.running:
                with listener.accept() as conn:
                    _converse(server, conn)
    finally:
        server.release_all()


def _converse(server: _Server, conn: Connection) -> None:
    try:
        while server.running and conn.poll(_IDLE_CLIENT):
            conn.send(server.handle(conn.recv()))
    except (EOFError, OSError):
        pass  # the client hung up, or died mid-request: nothing of its state to clean up
