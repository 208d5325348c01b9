"""Suite-wide guards: every test ends what it started and frees what it allocated."""

from __future__ import annotations

import os
import re
import time

import pytest

from leto_lightning.retained.shm import SEGMENT_PREFIX, SHM_DIR, list_segments

# Job ids made by new_job_id() in this session (and every process it starts) carry this prefix,
# so that concurrent sessions on one machine tell their segments apart. The leak guard does not
# rely on it: a job id given explicitly (LETO_JOB_ID, job_id=...), or an environment that drops
# the prefix, still makes /dev/shm/leto-* segments, and those are checked too.
os.environ["LETO_JOB_PREFIX"] = f"t{os.getpid()}x"
# Launched jobs start every trainer from a new interpreter unless a test asks for the warm
# template (``warm_template`` fixture): its imports cost each of the suite's ~100 launched jobs
# seconds of CPU on a 2-core machine. The end-to-end modules that must hold with forked trainers
# (plain PyTorch, Lightning and Accelerate launches, the ready-shadow case) turn it on.
os.environ.setdefault("LETO_WARM_TEMPLATE", "0")
OURS = SEGMENT_PREFIX + os.environ["LETO_JOB_PREFIX"]
_SESSION = re.compile(re.escape(SEGMENT_PREFIX) + r"t(\d+)x")


def _another_session(name: str) -> bool:
    """Named with the prefix of another pytest session that is still running."""
    match = _SESSION.match(name)
    if match is None or int(match.group(1)) == os.getpid():
        return False
    return os.path.exists(f"/proc/{match.group(1)}")


def _used_by_others(names: set[str]) -> set[str]:
    """Those of ``names`` some process other than this one maps or holds open: another job's
    live memory (this session's children are checked separately, by the orphan check)."""
    paths = {os.path.join(SHM_DIR, n): n for n in names}
    found: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                found.update(paths[p] for p in (line.rstrip("\n").split(maxsplit=5)[-1] for line in f) if p in paths)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    found.add(paths[target])
        except OSError:
            pass
    return found


def _leaked(before: set[str], grace: float = 3.0) -> set[str]:
    """Segments that appeared since ``before`` and that nobody else accounts for. Rare by
    construction, so only then: another job on the machine may be between its trainers' exit
    and its agent's cleanup, so such segments must stay for ``grace`` seconds to count."""
    deadline = time.monotonic() + grace
    while True:
        new = {n for n in set(list_segments(SEGMENT_PREFIX)) - before if not _another_session(n)}
        new = new - _used_by_others(new) if new else new
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.slow`` cases run with ``LETO_LONG=1`` (or ``-m slow``): end-to-end runs whose
    mechanism another case of ``python -m pytest -q`` already exercises, kept out of that command's
    15 minutes on 2 cores. CI runs them in a stage of their own after it (``.ci/run``:
    ``python -m pytest -q -m slow``)."""
    if os.environ.get("LETO_LONG") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow end-to-end case: LETO_LONG=1 runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
    """Fail a test that leaves a leto shared-memory segment (any ``/dev/shm/leto-*``, whatever its
    job id) or a child process behind."""
    before_segments = set(list_segments(SEGMENT_PREFIX))
    before_children = _children()
    yield
    leaked = _leaked(before_segments)
    orphans = _children() - before_children
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"
    assert not orphans, f"child processes left running: {sorted(orphans)}"


@pytest.fixture
def warm_template(monkeypatch):
    """Launched jobs of this test fork their later trainers from the warm template (the default
    outside the suite)."""
    monkeypatch.setenv("LETO_WARM_TEMPLATE", "1")
