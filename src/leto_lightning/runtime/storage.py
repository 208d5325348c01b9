"""Writing to the run directory when its filesystem may be full, or someone planted links in it.

Three rules: a file a reader may see is either the old one or the complete new one (write a
temporary file beside it, then ``os.replace``); a storage failure says so -- ``torch.save``
reports a full disk as an obscure ``RuntimeError`` ("unexpected pos ..."), which would
otherwise be taken for a trainer crash and recovered in place, forever; and Leto never reads or
writes through a symbolic link inside the run dir (``run_dir_path``, ``open_run_dir_file``):
whoever planted one (while the directory was writable to others, or through a directory of
theirs inside it) could otherwise point the job's appends and checkpoints at any file of yours.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable

from ..errors import ConfigurationError, LetoError

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
# What a trainer's reported exception says when the run dir's storage failed (classification).
STORAGE_MESSAGES = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                    "Input/output error", "run dir storage failed",
                    "PytorchStreamWriter failed", "unexpected pos")  # torch.save on a full disk (a RuntimeError)
NEARLY_FULL_BYTES = 1 << 20  # below this much free space a failed write is taken for a full disk


class StorageError(LetoError, OSError):
    """The run directory's storage failed (full, over quota, read-only): nothing a restart fixes."""


class PlantedLinkError(ConfigurationError):
    """A path Leto reads or writes inside the run dir is a symbolic link, or an entry that is not
    the user's own plain file or directory: refused, never followed."""


def is_storage_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def atomic_write(path: str, write: Callable[[str], None], mode: int | None = None) -> str:
    """``write(tmp)`` then ``os.replace(tmp, path)``; on failure the temporary file is removed
    (a full disk stays no fuller) and a full disk raises ``StorageError`` naming ``path``.

    The temporary file is created here, new (``O_EXCL``) and not through a link, before
    ``write`` opens it by name: a link planted at its predictable name is removed, never written
    through. ``mode``: its permissions (default: what the umask leaves of 0666)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        _create_new(tmp, mode)
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
    after a power loss or a killed node it is there whole, or not at all. A file below the
    directory that vanishes while it is walked (another rank's temporary, renamed) is skipped."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    for name in paths:
        try:
            fd = os.open(name, os.O_RDONLY)
        except FileNotFoundError:
            if name == path:
                raise
            # another rank's temporary file in a shared checkpoint directory, renamed since the
            # walk listed it: its writer makes the file it became durable itself
            continue
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


def _create_new(tmp: str, mode: int | None) -> None:
    try:
        os.unlink(tmp)  # a stale one of a dead writer with our pid, or a planted link: the link itself goes
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


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


def run_dir_path(run_dir: str, *parts: str, directory: bool = False) -> str:
    """``run_dir/parts...``, checked component by component below ``run_dir`` (the run dir itself
    may be a link of yours): every directory on the way is created if missing and must be a real
    directory of yours, never a link; the last part (``directory``: a directory, created too) must
    not be a link either. A link raises ``PlantedLinkError`` naming it and the fix."""
    path = run_dir
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        last = i == len(parts) - 1
        if not last or directory:
            try:
                os.mkdir(path, 0o777)  # the umask narrows it (the agent's: 077)
            except FileExistsError:
                pass
            _require_own_dir(path)
        else:
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    raise _planted_link(path)
            except FileNotFoundError:
                pass
    return path


def open_run_dir_file(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that does not follow a link at ``path`` and accepts only a regular file; to
    write, only one of yours with no other name (a hard link to another file of yours would be
    written through)."""
    try:
        # O_NONBLOCK: a FIFO in the file's place must not block the open (no effect on regular files)
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _planted_link(path) from None
        raise
    st = os.fstat(fd)
    writes = flags & (os.O_WRONLY | os.O_RDWR)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"belongs to uid {st.st_uid}, not to you" if writes and st.st_uid != os.geteuid() else
               f"has {st.st_nlink} names (hard links): writing it would change the others"
               if writes and st.st_nlink > 1 else "")
    if problem:
        os.close(fd)
        raise PlantedLinkError(f"{path} {problem}: Leto reads and writes only its own files in the run dir -- remove "
                               "it and relaunch (or pick another --run-dir)")
    return fd


def _require_own_dir(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _planted_link(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"{path} is not a directory: remove it and relaunch (or pick another --run-dir)")
    if st.st_uid != os.geteuid():
        raise PlantedLinkError(f"{path} belongs to uid {st.st_uid}, not to you: whoever owns it can change what the "
                               "job writes there -- remove it and relaunch (or pick another --run-dir)")


def _planted_link(path: str) -> PlantedLinkError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return PlantedLinkError(f"{path} is a symbolic link (to {target}): Leto never reads or writes through a link in "
                            f"its run dir -- remove it (rm {path}) and relaunch")
