"""Suite-wide guards: every test ends what it started and frees what it allocated."""

from __future__ import annotations

import os

import pytest

from leto_lightning.retained.shm import SEGMENT_PREFIX, list_segments

# Segments made by this test session carry this prefix; leak checks look at those only.
os.environ["LETO_JOB_PREFIX"] = f"t{os.getpid()}x"
OURS = SEGMENT_PREFIX + os.environ["LETO_JOB_PREFIX"]


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == me and fields[0] != "Z":
                    out.add(int(pid))
            except (OSError, IndexError):
                pass
    return out


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a leto shared-memory segment or a child process behind."""
    before_segments = set(list_segments(OURS))
    before_children = _children()
    yield
    leaked = set(list_segments(OURS)) - before_segments
    orphans = _children() - before_children
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"
    assert not orphans, f"child processes left running: {sorted(orphans)}"
