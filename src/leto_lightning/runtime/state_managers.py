"""The CUDA state managers of one agent: the processes that own its ranks' retained device memory.

Device memory dies with the process that allocated it, so no trainer may own its retained
buffers (docs/cuda-backend.md). The agent starts one state manager per local rank when the job
starts -- before any trainer, and whatever a trainer does later -- and tells each trainer its
manager's address (``LETO_CUDA_MANAGER``). A manager initialises CUDA only at its first
allocation, on the device the trainer asks for (the one its model trains on), so a job that
trains on the CPU pays one idle interpreter per rank and no device memory, and nothing at all
with a CPU-only build of torch (no manager is started). The managers outlive every trainer
generation and are shut down -- their memory freed -- when the agent ends the job; after an
agent that was SIGKILLed, ``leto cleanup RUN_DIR`` stops them (their sockets are in the run
directory).
"""

from __future__ import annotations

import glob
import logging
import os

import torch

from ..errors import DeviceManagerError
from ..retained.backends.cuda_ipc import CudaStateManager

log = logging.getLogger(__name__)

SOCKET_GLOB = "leto-*-statemgr.sock"
_SOCKET_MAX = 100  # AF_UNIX paths are limited to 107 bytes


def socket_path(run_dir: str, job_id: str, local_rank: int) -> str:
    """Where the manager of ``local_rank`` listens: in the run directory (so ``leto cleanup``
    finds it), else the temp directory when that path is too long for a Unix socket."""
    name = f"leto-{job_id}-l{local_rank}-statemgr.sock"
    path = os.path.join(os.path.abspath(run_dir), name)
    return path if len(path) <= _SOCKET_MAX else os.path.join("/tmp", name)


class NodeStateManagers:
    """One lazily-initialised CUDA state manager per local rank of this agent."""

    def __init__(self, managers: dict[int, CudaStateManager]) -> None:
        self.managers = managers

    @classmethod
    def launch(cls, run_dir: str, job_id: str, local_ranks: range) -> NodeStateManagers:
        """Start them without waiting (each imports torch: seconds, beside the trainers' start).
        None are started with a torch build that has no CUDA."""
        if torch.version.cuda is None:
            return cls({})
        managers = {}
        for local in local_ranks:
            managers[local] = CudaStateManager.start(socket_path(run_dir, job_id, local), "lazy", wait=False)
        return cls(managers)

    def address(self, local_rank: int) -> str:
        """The address a trainer of ``local_rank`` allocates from ("" when none runs)."""
        manager = self.managers.get(local_rank)
        return manager.address if manager is not None else ""

    def shutdown(self) -> None:
        """Free every buffer and stop every manager (idempotent)."""
        for local, manager in sorted(self.managers.items()):
            try:
                manager.shutdown()
            except DeviceManagerError as exc:  # already gone: its memory went with it
                log.debug("state manager of local rank %d: %s", local, exc)
        self.managers = {}


def stop_orphans(run_dir: str) -> list[str]:
    """Shut down the state managers listening in ``run_dir`` (their agent is gone: ``leto
    cleanup``); returns the sockets of the ones that answered."""
    stopped = []
    for path in sorted(glob.glob(os.path.join(run_dir, SOCKET_GLOB))):
        try:
            CudaStateManager(path).stats()
        except DeviceManagerError:
            continue  # nothing listens: a stale socket file of a manager that exited
        CudaStateManager(path).shutdown()
        stopped.append(path)
    return stopped
