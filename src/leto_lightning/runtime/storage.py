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


def durable(path: str) -> None:
    """fsync ``path`` (a file, or every file below a directory) and the directory that holds it:
    after a power loss or a killed node it is there whole, or not at all."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    parent = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)


def replace_dir(staged: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the complete directory ``staged`` in place of ``path`` (a checkpoint rewritten in
    place): the old one is renamed aside first and removed last, so a crash leaves either of
    them whole -- at worst the old one under ``.<name>.old``, which ``restore_replaced`` puts
    back."""
    staged, path = os.fspath(staged), os.fspath(path)
    durable(staged)
    old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")
    if os.path.exists(old):
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staged, path)
    durable(path)
    if os.path.exists(old):
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)


def restore_replaced(directory: str | os.PathLike) -> list[str]:
    """Put back what a crash between ``replace_dir``'s two renames left aside (the old checkpoint
    whose replacement never arrived); returns the paths restored."""
    directory = os.fspath(directory)
    restored = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith(".") and name.endswith(".old"):
            target = os.path.join(directory, name[1:-len(".old")])
            if not os.path.exists(target):
                os.rename(os.path.join(directory, name), target)
                restored.append(target)
    return restored


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
