"""The agent's checkpoint fallback with ``LetoAccelerator``: which ``save_state`` checkpoint a
restart with ``LETO_RESUME=checkpoint`` loads.

When retained state cannot be used (damage beyond parity, a failure that is not a HOF), the
agent frees it and restarts every trainer with ``LETO_RESUME=checkpoint`` (a new job id, the
same run directory). The script is unchanged, so nothing in it says where the checkpoints are:
under an agent each rank's ``save_state`` appends ``(retained iteration, directory)`` to
``<run dir>/accelerate/checkpoints_rank<r>.json`` (rewritten atomically, after the checkpoint's
files are complete), and a restarted rank loads the newest iteration that **every** rank
recorded (agreed by one ``all_gather_object``: a rank that died while saving has not recorded
that checkpoint, so nobody loads it). A job's first trainers (``LETO_RESUME`` empty) forget
the records a previous job left in the same run directory.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

import torch

from ...env import RESUME, ResumeMode
from ...runtime.storage import durable

log = logging.getLogger(__name__)

RECORD = os.path.join("accelerate", "checkpoints_rank{rank}.json")  # not in checkpoints/: Accelerate's
# automatic checkpoint naming takes every entry there for a checkpoint folder


def record_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, RECORD.format(rank=rank))


def restarting_from_checkpoint(env: Mapping[str, str] = os.environ) -> bool:
    """This trainer was started by the agent's checkpoint fallback."""
    return env.get(RESUME, "") == ResumeMode.CHECKPOINT


def starting_fresh(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(RESUME, "") == ResumeMode.FRESH


def saved(run_dir: str, rank: int) -> dict[int, str]:
    """{retained iteration: checkpoint directory} this rank recorded."""
    path = record_path(run_dir, rank)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {int(it): directory for it, directory in json.load(f).items()}


def remember(run_dir: str, rank: int, iteration: int, directory: str) -> None:
    """Record a complete checkpoint of this rank (called after its files are written): they are
    made durable first, so a record never names files a power loss could still take."""
    durable(directory)
    records = saved(run_dir, rank)
    records[iteration] = os.path.abspath(directory)
    path = record_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({str(it): d for it, d in sorted(records.items())}, f)
    os.replace(path + ".tmp", path)  # a crash while writing leaves the previous record
    durable(path)


def forget(run_dir: str, rank: int) -> None:
    """A new job in this run directory: a previous job's checkpoints are not its own."""
    path = record_path(run_dir, rank)
    if os.path.exists(path):
        os.remove(path)


def newest_common(run_dir: str, rank: int, world: int) -> tuple[int, str] | None:
    """The newest checkpoint every rank recorded: (iteration, this rank's directory), or None.
    A collective over the default process group when ``world > 1``."""
    mine = saved(run_dir, rank)
    everyone: list = [sorted(mine)]
    if world > 1 and torch.distributed.is_initialized():
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, sorted(mine))
    newest = newest_of_all(everyone)
    if newest is None:
        log.info("rank %d: no checkpoint every rank saved in %s: the job starts over", rank, run_dir)
        return None
    return newest, mine[newest]


def newest_of_all(everyone: list[list[int]]) -> int | None:
    """The newest iteration in every rank's list (a rank that died while saving lacks it)."""
    common = set.intersection(*(set(its) for its in everyone))
    return max(common) if common else None
