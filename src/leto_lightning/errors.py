"""The exceptions of leto-lightning: one root, a few branches, each meaning one thing to do.

::

    LetoError
    +-- ConfigurationError (also ValueError)   a bad setting or argument: fix it and start again
    |   +-- SharedMemoryCapacityError           /dev/shm cannot hold the retained state (found before allocating)
    |   +-- CudaUnavailableError (also RuntimeError)  backend="cuda" where torch sees no CUDA device
    |   +-- UnsafeCheckpoint                    a checkpoint file holds more than tensors and containers
    +-- UsageError (also RuntimeError)          the API was called out of order
    +-- LetoTimeoutError (also TimeoutError)    something did not happen in time
    +-- InternalError (also RuntimeError)       a bug in leto-lightning (a broken invariant, e.g. an
    |                                           illegal state transition): report it, never fall back
    +-- MissingExtraError (also ImportError)    an optional dependency is not installed: the
                                                message names the extra that installs it
    +-- RetainedStateError (also RuntimeError)  the retained state cannot be used: fall back to
        |                                       the last checkpoint (or a fresh start)
        +-- DeviceManagerError                  the CUDA state manager holding it is gone or failed
        +-- IncompleteStoreError                the store was never completely initialised and
        |                                       protected (its creator died during set-up)
        +-- ProtectionError                     parity could not protect or repair it
            +-- UnrecoverableDamageError        more damage than checksums, copies and parity cover
            +-- RecoveryError                   no consistent iteration can be reached

Catch the narrowest branch: ``except RetainedStateError`` is "resume from the checkpoint";
``except ConfigurationError`` (or the older ``except ValueError``) is a user error.

Here: the root, its branches, and the errors one layer raises and another catches or
classifies (``runtime/config.py`` stops a job on ``SharedMemoryCapacityError`` by name). Errors
that stay inside one layer are defined beside their code, each a subclass of a branch here
(``protection/errors.py``, ``runtime/phases.py``, ``runtime/storage.py``, ...).

A leaf module: it imports nothing from the package, so every layer (protection/ included)
may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

CHECKPOINT_ADVICE = "Resume from the last checkpoint instead; the retained state must not be used."


class LetoError(Exception):
    """Root of every exception leto-lightning raises on purpose."""


class ConfigurationError(LetoError, ValueError):
    """A setting or argument is invalid; the message names the value and the fix."""


class SharedMemoryCapacityError(ConfigurationError):
    """``/dev/shm`` has less free space than the segments to create need: found before
    allocating (a segment the kernel cannot back kills its user with SIGBUS at first touch).
    Raised by ``retained/shm.py``; the agent stops the job on it (``runtime/config.py``)."""


class CudaUnavailableError(ConfigurationError, RuntimeError):
    """``backend="cuda"`` where torch cannot use a CUDA device (``retained/backends``)."""


class UnsafeCheckpoint(ConfigurationError):
    """A checkpoint holds more than tensors and plain containers: refused, never unpickled
    (``runtime/session.py``; the Accelerate integration's checkpoints too)."""


class UsageError(LetoError, RuntimeError):
    """An API was called out of order (e.g. binding a shadow before recovery ran)."""


class ArgumentError(LetoError, TypeError):
    """A Leto object was called with arguments it does not take (e.g. ``step(**kwargs)`` of a
    retained optimizer, which takes only the closure)."""


class LetoTimeoutError(LetoError, TimeoutError):
    """A process or event did not arrive within its deadline."""


class MissingExtraError(LetoError, ImportError):
    """An optional dependency (plots, the demo's tables, Lightning, ...) is not installed; the
    message names the ``pip install "leto-lightning[EXTRA]"`` that brings it (``extras.py``)."""


class InternalError(LetoError, RuntimeError):
    """A bug in leto-lightning: an invariant broke (e.g. an illegal state transition). Never
    caught as "fall back to the checkpoint": it must surface."""


class RetainedStateError(LetoError, RuntimeError):
    """The retained state cannot be used: resume from the last checkpoint (or start fresh)."""


class DeviceManagerError(RetainedStateError):
    """The CUDA state manager cannot be reached, or failed (``retained/backends``; the agent's
    ``runtime/state_managers.py`` catches it)."""


class IncompleteStoreError(RetainedStateError):
    """A store's "completely initialised and protected" mark is missing or invalid: its creator
    died during set-up (or the set-up never finished), so nothing in it can be trusted."""


class ProtectionError(RetainedStateError):
    """Retained state could not be protected or repaired."""


class UnrecoverableDamageError(ProtectionError):
    """More is damaged than checksums, redundant copies and parity can rebuild.

    ``lost``: rank -> the data pages that stay lost (may be empty when the damage is in
    metadata, parity or the undo buffer); ``details``: one sentence per finding, each naming the
    segment and page/group/word.
    """

    def __init__(self, lost: Mapping[int, Sequence[int]], details: Sequence[str]) -> None:
        self.lost = {r: sorted(p) for r, p in lost.items() if p}
        self.details = list(details)
        pages = "; ".join(f"rank {r}: pages {p[:16]}{'...' if len(p) > 16 else ''}" for r, p in self.lost.items())
        where = f" ({pages})" if pages else ""
        super().__init__(
            f"retained state damaged beyond what checksums, copies and parity can repair{where}. "
            + " ".join(self.details[:8])
            + (f" (+{len(self.details) - 8} more)" if len(self.details) > 8 else "")
            + " " + CHECKPOINT_ADVICE
        )


class RecoveryError(ProtectionError):
    """Retained state cannot be brought back to a consistent iteration; use a checkpoint."""
