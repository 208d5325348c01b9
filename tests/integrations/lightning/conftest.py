"""Fixtures for the Lightning integration tests: one intra-op thread, quiet Lightning, and a
retained-memory job id whose segments are always unlinked."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import leto_lightning.integrations.lightning  # noqa: F401  (registers "leto")
from leto_lightning import new_job_id
from leto_lightning.retained.shm import unlink_segments

torch.set_num_threads(1)
for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(LeafSpec|litlogger|does not have many workers).*")
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        yield


@pytest.fixture
def job():
    """A job id for retained memory; every segment of it is freed after the test."""
    job_id = new_job_id()
    yield job_id
    unlink_segments(job_id)


@pytest.fixture
def jobs():
    """Several job ids (``jobs()`` makes one); all freed after the test."""
    made: list[str] = []

    def make() -> str:
        made.append(new_job_id())
        return made[-1]

    yield make
    for job_id in made:
        unlink_segments(job_id)
