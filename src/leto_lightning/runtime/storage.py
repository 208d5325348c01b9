"""Writing to the run directory when its filesystem may be full.

Two rules: a file a reader may see is either the old one or the complete new one (write a
temporary file beside it, then ``os.replace``), and a storage failure says so -- ``torch.save``
reports a full disk as an obscure ``RuntimeError`` ("unexpected pos ..."), which would
otherwise be taken for a trainer crash and recovered in place, forever.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable

from ..errors import LetoError

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
# What a trainer's reported exception says when the run dir's storage failed (classification).
STORAGE_MESSAGES = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                    "Input/output error", "run dir storage failed",
                    "PytorchStreamWriter failed", "unexpected pos")  # torch.save on a full disk (a RuntimeError)
NEARLY_FULL_BYTES = 1 << 20  # below this much free space a failed write is taken for a full disk


class StorageError(LetoError, OSError):
    """The run directory's storage failed (full, over quota, read-only): nothing a restart fixes."""


def is_storage_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """``write(tmp)`` then ``os.replace(tmp, path)``; on failure the temporary file is removed
    (a full disk stays no fuller) and a full disk raises ``StorageError`` naming ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        full = is_storage_error(exc) or _nearly_full(directory)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if full:
            raise StorageError(errno.ENOSPC, f"run dir storage failed writing {path} (No space left on device; "
                                             f"{type(exc).__name__}: {exc}): free space there and relaunch") from exc
        raise
    return path


def atomic_torch_save(obj: object, path: str) -> str:
    """``torch.save`` that never leaves a partial file at ``path``."""
    import torch

    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _nearly_full(directory: str) -> bool:
    try:
        return shutil.disk_usage(directory).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def usable_run_dir(path: str, mode: int = 0o700) -> str:
    """Create ``path`` (and parents, ``mode``: private by default) if needed; a path that is a
    file, below a file, or a directory this user cannot write raises ``ConfigurationError``
    naming it -- before anything starts."""
    from ..errors import ConfigurationError

    try:
        os.makedirs(path, mode=mode, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"run dir {path!r} cannot be used ({exc.strerror}: {exc.filename}): pick another "
                                 "--run-dir, a directory you can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigurationError(f"run dir {path!r} is not writable by this user: pick another --run-dir")
    return path
