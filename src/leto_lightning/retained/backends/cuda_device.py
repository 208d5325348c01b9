"""What both sides of the CUDA backend share: its errors, the check that CUDA is usable, a
device's UUID. Its own module so that the trainer's side (``cuda_ipc``) and the manager process
(``cuda_server``) both import it and neither imports the other at module level.
"""

from __future__ import annotations

import os

import torch

from ...errors import CudaUnavailableError

__all__ = ["gpu_uuid", "require_cuda"]


def require_cuda() -> None:
    """Raise CudaUnavailableError, saying what to do, unless torch can use a CUDA device."""
    if torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"this torch build ({torch.__version__}) has no CUDA support"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        why = f"torch sees no CUDA device (driver not loaded? CUDA_VISIBLE_DEVICES={visible!r})"
    raise CudaUnavailableError(
        f"RetainedConfig(backend='cuda') needs a CUDA device, but {why}. Use RetainedConfig(backend='cpu') "
        "(retained state in POSIX shared memory) on this machine, or run on a machine with an NVIDIA GPU "
        "and a CUDA build of torch."
    )


def gpu_uuid(device: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
