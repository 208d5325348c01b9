"""Job-wide checkpoint commits (``runtime/checkpoints.py``): a checkpoint iteration is used only
once every rank finished writing it, and every rank restarts from the same one.

The ranks here are threads over one in-process store (the commit protocol is what is tested;
``tests/runtime/test_inplace_recovery.py`` runs it in a launched job with a SIGKILL mid-save).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch.distributed as dist

from leto_lightning.errors import LetoTimeoutError
from leto_lightning.runtime.checkpoints import COMMIT_MARK, CheckpointCommits
from leto_lightning.runtime.control import SignedStore


def _ranks(base, world: int, generation: int = 0) -> list[CheckpointCommits]:
    store = SignedStore(dist.HashStore(), os.urandom(16))
    return [CheckpointCommits(str(base), r, world, store, generation) for r in range(world)]


def _save(commits: CheckpointCommits, iteration: int) -> str:
    path = os.path.join(commits.directory(iteration), f"rank{commits.rank}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{iteration}")
    return path


def _at_once(calls: list[Callable[[], object]]) -> list[object]:
    """Each call in its own thread, as the job's ranks make them (each waits for the others);
    their results, in order."""
    got: list[object] = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, call=call: got.__setitem__(i, call()))
               for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def _save_all(ranks: list[CheckpointCommits], iteration: int) -> None:
    _at_once([lambda c=c: c.saved(iteration, [_save(c, iteration)]) for c in ranks])


def test_committed_only_once_every_rank_wrote_it(tmp_path):
    ranks = _ranks(tmp_path, 2)
    _save_all(ranks, 10)
    assert os.path.exists(os.path.join(ranks[0].directory(10), COMMIT_MARK))
    # iteration 20: rank 0 writes and announces, rank 1 dies before writing -- never committed
    with pytest.raises(LetoTimeoutError, match="not every rank finished"):
        ranks[0].saved(20, [_save(ranks[0], 20)], timeout_s=0.3)
    assert not os.path.exists(os.path.join(ranks[0].directory(20), COMMIT_MARK))
    restarted = _ranks(tmp_path, 2, generation=1)
    got = _at_once([r.newest_committed for r in restarted])
    assert got == [10, 10]  # not 20 for rank 0 and 10 for rank 1
    assert sorted(os.listdir(ranks[0].directory(10))) == [COMMIT_MARK, "rank0.pt", "rank1.pt"]


def test_older_checkpoints_stay_until_a_newer_one_is_committed(tmp_path):
    ranks = _ranks(tmp_path, 2)
    _save_all(ranks, 10)
    _save(ranks[0], 20)  # written but not committed: 10 must stay
    assert ranks[0].iterations() == [10, 20] and ranks[0].newest_committed_here() == 10
    _save_all(ranks, 20)
    assert ranks[0].iterations() == [20] and ranks[0].newest_committed_here() == 20


def test_a_mark_on_one_node_is_enough(tmp_path):
    """Two nodes, each with its own run directory: node 1's rank died after every rank had
    announced iteration 20 but before it wrote its mark. Node 0's mark proves all files exist
    (a rank drops a file only after a newer mark): both restart from 20."""
    store = SignedStore(dist.HashStore(), os.urandom(16))
    node0, node1 = (CheckpointCommits(str(tmp_path / f"node{n}"), n, 2, store) for n in (0, 1))
    _save_all([node0, node1], 10)
    _save(node1, 20)
    store.set("ckpt/20/1", "1")  # node 1 announced, then died before its mark
    node0.saved(20, [_save(node0, 20)], timeout_s=5)
    assert node0.newest_committed_here() == 20 and node1.newest_committed_here() == 10
    restarted = [CheckpointCommits(c.base, c.rank, 2, store, generation=1) for c in (node0, node1)]
    assert _at_once([r.newest_committed for r in restarted]) == [20, 20]
    assert os.path.exists(os.path.join(node1.directory(20), "rank1.pt"))


def test_a_rewritten_checkpoint_directory_is_old_or_new_never_mixed(tmp_path):
    """``replace_dir`` (the Lightning FSDP2 strategy's distributed checkpoints, rewritten in place
    as last.ckpt): the new directory only ever replaces the old one whole; a crash between its
    two renames leaves the old one aside, and ``restore_replaced`` puts it back."""
    from leto_lightning.runtime.storage import replace_dir, restore_replaced

    last, staged = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.saving"
    for where, tag in ((last, "old"), (staged, "new")):
        where.mkdir()
        for rank in range(2):
            (where / f"shard{rank}").write_text(tag)
    replace_dir(staged, last)
    assert {p.read_text() for p in last.iterdir()} == {"new"} and not staged.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    os.rename(last, tmp_path / ".last.ckpt.old")  # a crash right after the first rename
    assert restore_replaced(tmp_path) == [str(last)]
    assert {p.read_text() for p in last.iterdir()} == {"new"}
