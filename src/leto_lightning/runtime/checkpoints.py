"""Job-wide checkpoint commits: a checkpoint is used only once every rank finished writing it.

Every rank writes its own checkpoint files, and any rank may die while it writes. If each rank
then restarted from the newest checkpoint *it* finished, a rank killed mid-save would resume one
checkpoint earlier than the others, and their all-reduces would pair different iterations --
silently wrong weights. So a checkpoint iteration is **committed** for the whole job only once
every rank's files of it are durable:

1. a rank writes its files (atomically, fsync'd: ``storage.durable``) and announces it in the
   job's store (``ckpt/<iteration>/<rank>``);
2. it waits until every rank announced the same iteration, then writes the commit mark
   ``checkpoints/it<iteration>/COMMITTED`` in its run directory (each node's run directory gets
   one) and only then deletes its own files of older iterations -- an older checkpoint stays
   until a newer one is committed;
3. a restart (``LETO_RESUME=checkpoint``) takes the newest iteration *any* rank marked committed
   (a mark proves every rank's files of it exist: a rank deletes a file only after a newer mark)
   -- agreed through the store, so every rank of every node loads the same iteration.

``CheckpointCommits`` is the one implementation; the plain-PyTorch ``Session``, the Lightning
strategies and ``LetoAccelerator`` use it for the checkpoints they write or record.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable

from ..errors import LetoTimeoutError
from .control import SignedStore
from .storage import durable

COMMIT_MARK = "COMMITTED"
CKPT_SAVED = "ckpt/{it}/{rank}"  # a rank's files of checkpoint iteration ``it`` are durable
CKPT_NEWEST = "ckptnewest/{gen}/{rank}"  # a restarting rank's newest committed iteration (-1: none)
_ITERATION_DIR = re.compile(r"^it(\d+)$")
POLL_S = 0.02


class CheckpointCommits:
    """Checkpoint iterations of one job, committed job-wide (module doc). ``base`` is the
    directory that holds one ``it<iteration>`` directory per checkpoint iteration."""

    def __init__(self, base: str, rank: int, world_size: int, store: SignedStore, generation: int = 0,
                 stop: Callable[[], None] | None = None) -> None:
        self.base, self.rank, self.world_size = base, rank, world_size
        self.store, self.generation = store, generation
        self._stop = stop or (lambda: None)

    def directory(self, iteration: int) -> str:
        return os.path.join(self.base, f"it{iteration:09d}")

    # -- saving --------------------------------------------------------------------------
    def saved(self, iteration: int, files: list[str], timeout_s: float = 600.0) -> None:
        """This rank's ``files`` of checkpoint ``iteration`` are written: make them durable,
        announce them, and once every rank announced, commit the iteration here and drop this
        rank's older ones. ``LetoTimeoutError`` if the others never finish (a peer died:
        the agent is stopping the job meanwhile)."""
        for path in files:
            durable(path)
        self.store.set(CKPT_SAVED.format(it=iteration, rank=self.rank), "1")
        keys = [CKPT_SAVED.format(it=iteration, rank=r) for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                raise LetoTimeoutError(f"checkpoint {iteration}: not every rank finished writing it within "
                                       f"{timeout_s:.0f} s; it is not committed")
            self._stop()
            time.sleep(POLL_S)
        mark = os.path.join(self.directory(iteration), COMMIT_MARK)
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        with open(mark, "w") as f:
            f.write(f"{iteration}\n")
        durable(mark)
        self._drop_older(iteration)

    def _drop_older(self, iteration: int) -> None:
        """This rank's files of iterations before ``iteration`` (committed, so never needed
        again); a directory left empty goes too."""
        for older in self.iterations():
            if older >= iteration:
                continue
            where = self.directory(older)
            try:
                names = os.listdir(where)
            except FileNotFoundError:  # another rank of this node removed it
                continue
            for name in names:
                if _owned_by(name, self.rank) or name == COMMIT_MARK:  # the mark: any rank of the node may
                    _remove(os.path.join(where, name))
            try:
                os.rmdir(where)
            except OSError:  # another rank's files are still there (or it is gone already)
                pass

    # -- restarting -------------------------------------------------------------------------
    def iterations(self) -> list[int]:
        """Checkpoint iterations with a directory here, oldest first."""
        if not os.path.isdir(self.base):
            return []
        found = (_ITERATION_DIR.match(name) for name in os.listdir(self.base))
        return sorted(int(m.group(1)) for m in found if m)

    def newest_committed_here(self) -> int | None:
        marked = [it for it in self.iterations() if os.path.exists(os.path.join(self.directory(it), COMMIT_MARK))]
        return marked[-1] if marked else None

    def newest_committed(self, timeout_s: float = 600.0) -> int | None:
        """The newest iteration any rank of the job marked committed (None: none), the same on
        every rank: each rank publishes what its run directory shows and takes the newest."""
        mine = self.newest_committed_here()
        self.store.set(CKPT_NEWEST.format(gen=self.generation, rank=self.rank), str(-1 if mine is None else mine))
        keys = [CKPT_NEWEST.format(gen=self.generation, rank=r) for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                raise LetoTimeoutError(f"the ranks' newest checkpoints were not all published within {timeout_s:.0f} s")
            self._stop()
            time.sleep(POLL_S)
        newest = max(int(self.store.get(k)) for k in keys)
        return None if newest < 0 else newest


def _remove(path: str) -> None:
    """Delete a file or directory that another rank of the node may be deleting too."""
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _owned_by(name: str, rank: int) -> bool:
    """A file or directory of ``rank`` inside an iteration directory: ``rank<r>.pt``,
    ``rank<r>`` or ``rank<r>.<anything>``."""
    stem = name.split(".", 1)[0]
    return stem == f"rank{rank}"
