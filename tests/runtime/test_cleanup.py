"""``leto cleanup``: refuses memory a process still maps, frees it once nobody does."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from leto_lightning import cli
from leto_lightning.retained.shm import SHM_DIR, list_segments, unlink_segments
from leto_lightning.runtime.cleanup import retained_jobs
from leto_lightning.testing.scenario import CoreScenario


def _holder() -> tuple[int, str, int]:
    """A forked process that creates a job's store and keeps it mapped until told to exit:
    (its pid, the job id, the write end that tells it)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(ready_r)
            os.close(go_w)
            job = CoreScenario(n_ranks=1).create_job()
            os.write(ready_w, job.job_id.encode())
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    job_id = os.read(ready_r, 256).decode()
    os.close(ready_r)
    return pid, job_id, go_w


def test_cleanup_refuses_mapped_memory_and_frees_it_once_unmapped(capsys) -> None:
    pid, job_id, go = _holder()  # another process maps the store, as a live trainer does
    try:
        info = retained_jobs()[job_id]
        assert info.segments and info.nbytes > 0 and info.users
        assert cli.main(["cleanup", "--job", job_id]) == 1
        assert f"in use by pid(s) [{pid}]" in capsys.readouterr().out
        assert list_segments(f"leto-{job_id}-")
        assert cli.main(["cleanup", "--job", job_id, "--dry-run", "--force"]) == 0
        assert list_segments(f"leto-{job_id}-")  # a dry run frees nothing
        os.write(go, b"x")  # it exits: nothing maps the memory any more
        os.waitpid(pid, 0)
        assert cli.main(["cleanup", "--job", job_id]) == 0
        assert "freed" in capsys.readouterr().out
        assert list_segments(f"leto-{job_id}-") == []
    finally:
        os.close(go)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        unlink_segments(job_id)


def test_cleanup_needs_a_target(tmp_path, capsys) -> None:
    assert cli.main(["cleanup"]) == 2
    assert cli.main(["cleanup", str(tmp_path)]) == 2  # no events.jsonl there
    assert "no job id" in capsys.readouterr().err


NOBODY = 65534


def _as_user(uid: int, argv: list[str]) -> tuple[int, str]:
    """``leto cleanup ARGV`` in a forked child that dropped to ``uid``: (exit code, output)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code, out = 99, io.StringIO()
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = cli.main(argv)
        except BaseException as exc:
            out.write(f"Traceback: {exc!r}")
        finally:
            os.write(w, json.dumps([code, out.getvalue()]).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(data))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (setuid) and to chown segments")
def test_cleanup_by_another_user_touches_nothing_of_the_owner(tmp_path):
    job = CoreScenario(n_ranks=1).create_job()
    try:
        for store in job.stores:  # nobody maps it now: to its owner it would be free
            store.close()
        names = list_segments(f"leto-{job.job_id}-")
        for argv in (["--dry-run"], [], ["--force"]):
            code, out = _as_user(NOBODY, ["cleanup", "--job", job.job_id, *argv])
            assert code == 1 and "belong to uid 0, not to you" in out and "Traceback" not in out, out
            assert "free" not in out.replace("not freed", "")
        code, out = _as_user(NOBODY, ["cleanup", "--list"])
        assert code == 0 and "no Leto retained memory of yours" in out, out
        assert list_segments(f"leto-{job.job_id}-") == names
        run_dir = tmp_path / "run"  # the owner's run dir (0700): unreadable to the other user
        run_dir.mkdir(mode=0o700)
        (run_dir / "events.jsonl").write_text(json.dumps({"event": "job_started", "job_id": job.job_id}) + "\n")
        code, out = _as_user(NOBODY, ["cleanup", str(run_dir)])
        assert code == 2 and "not readable by you" in out and "Traceback" not in out, out
        for name in names:  # the other way round: the owner's cleanup leaves another user's segments
            os.chown(os.path.join(SHM_DIR, name), NOBODY, NOBODY)
        assert cli.main(["cleanup", "--job", job.job_id, "--force"]) == 1
        assert list_segments(f"leto-{job.job_id}-") == names
    finally:
        for name in list_segments(f"leto-{job.job_id}-"):
            os.chown(os.path.join(SHM_DIR, name), 0, 0)
        job.close()
    assert list_segments(f"leto-{job.job_id}-") == []
