"""The fault-free plain FSDP2 run every test of this directory compares with (run once)."""

from __future__ import annotations

import pytest
import torch

from .fsdp2_job import STEPS, WORLD, Job, run_ranks


def run_job(directory, name: str, **kw) -> list[dict]:
    """Run ``Job(**kw)`` on forked ranks; every rank must end with exit code 0."""
    out = directory / name
    out.mkdir()
    codes = run_ranks(Job(rendezvous=str(directory / f"{name}.rdzv"), out_dir=str(out), steps=STEPS, **kw))
    assert codes == dict.fromkeys(range(WORLD), 0), f"{name}: rank exit codes {codes}"
    return [torch.load(out / f"r{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="session")
def plain_fsdp2(tmp_path_factory) -> list[dict]:
    """Plain FSDP2 + torch.optim.AdamW, per rank: losses, grad norms, local params and state."""
    return run_job(tmp_path_factory.mktemp("fsdp2"), "plain")
