"""Every expected failure of the CLI is one line naming the value and the fix, and a non-zero
exit -- never a traceback (issue 15 items 9 and 10). All in this interpreter: no job starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
import torch

from leto_lightning import cli
from leto_lightning.examples import PLAIN_DDP


@pytest.fixture
def leto(capsys):
    """Run ``leto ARGS`` in-process; returns (exit code, stderr+stdout)."""
    threads = torch.get_num_threads()

    def call(*args: str) -> tuple[int, str]:
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse
            code = exc.code
        finally:
            torch.set_num_threads(threads)  # an agent sets 1 for itself
        out = capsys.readouterr()
        return code, (out.err + out.out).strip()

    return call


def _one_line(code, text: str, *needles: str) -> None:
    assert code not in (0, None), text
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("[leto]")]
    assert len(lines) == 1, text
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_launch_inputs_refused_before_anything_starts(leto, tmp_path):
    run = ["--run-dir", str(tmp_path / "run")]
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["--faults", "[1,2]"], "--faults", "id"),
        (["--faults", "{nope"], "--faults", "JSON"),
        (["--master-port", "99999"], "99999", "1..65535"),
        (["--master-port", str(busy.getsockname()[1])], str(busy.getsockname()[1]), "in use"),
        (["--master-addr", "256.1.1.1"], "256.1.1.1", "address"),
        (["--nproc-per-node", "64"], "64", "cores"),
        (["--run-dir", str(a_file)], str(a_file), "--run-dir"),
        (["--run-dir", str(a_file / "below")], "below", "--run-dir"),
        (["--run-dir-mode", "0777"], "'0777'", "others write", "0700"),  # issue 25 item 7
        (["--run-dir-mode", "0770"], "'0770'", "others write", "0700"),
    ]
    try:
        for extra, *needles in cases:
            args = run + extra if "--run-dir" not in extra else extra
            _one_line(*leto("launch", *args, PLAIN_DDP), *needles)
    finally:
        busy.close()
    _one_line(*leto("launch", *run, str(tmp_path / "missing.py")), "missing.py", "not found")
    _one_line(*leto("launch", "--nproc-per-node", "x", PLAIN_DDP), "--nproc-per-node", "--help")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write: a read-only tmpfs as root (root ignores permissions), else 0500."""
    path = tmp_path / "ro"
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        path.chmod(0o500)
    yield path
    if mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
    else:
        path.chmod(0o700)


def test_unwritable_run_dir(leto, read_only_dir):
    for command in (["launch", "--run-dir", str(read_only_dir), PLAIN_DDP],
                    ["train", "olmoe", "size=tiny", "--run-dir", str(read_only_dir)],
                    ["demo", "--run-dir", str(read_only_dir)]):
        _one_line(*leto(*command), str(read_only_dir), "--run-dir")


def test_train_demo_simulate_inputs(leto, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n  size: tiny\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _one_line(*leto("train", str(bad_yaml), "--run-dir", str(tmp_path / "t")), "bad.yaml", "YAML")
    _one_line(*leto("train", "olmoe", "size=tiny", "leto.tier1_parity=99", "--run-dir", str(tmp_path / "t")),
              "tier1_parity")
    _one_line(*leto("train", "olmoe", "size=tiny", "--run-dir", str(a_file)), str(a_file))
    _one_line(*leto("demo", "--core", "--optimizer", "bogus"), "bogus", "adamw")
    _one_line(*leto("demo", "--hof-every", "-1"), "--hof-every -1")
    _one_line(*leto("demo", "--run-dir", str(a_file)), str(a_file))
    _one_line(*leto("simulate", "--gpus", "1e12"), "--gpus")
    _one_line(*leto("simulate", "--mttf", "1e-6s"), "MTTF", "--mttf")
    _one_line(*leto("simulate", "--mttf", "1s"), "MTTF", "--mttf")


def test_event_logs_readers_and_debug(leto, tmp_path, monkeypatch):
    """A record without "event" is named by its line; a torn last line (a write cut short by a
    full disk) is skipped, so `leto cleanup RUN_DIR` still works; --debug shows the traceback."""
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1, "generation": 0}) + "\n")
    _one_line(*leto("cleanup", str(tmp_path)), "line 1", "event")
    good = {"time": 1, "event": "job_started", "generation": 0, "job_id": "e15nosuchjob", "pid": 2 ** 22 + 7}
    (tmp_path / "events.jsonl").write_text(json.dumps(good) + "\n" + '{"time": 2, "event": "proc')
    code, text = leto("cleanup", str(tmp_path))
    assert code == 0 and "no retained memory left" in text, text
    with pytest.raises(ValueError):
        leto("--debug", "launch", "--master-port", "99999", PLAIN_DDP)
    monkeypatch.setenv("LETO_DEBUG", "1")
    with pytest.raises(ValueError):
        leto("launch", "--master-port", "99999", PLAIN_DDP)


def test_cleanup_frees_a_job_whose_prefix_has_dashes(leto, monkeypatch):
    """``LETO_JOB_PREFIX`` with '-' (item 11): the job's segments are found and freed."""
    from leto_lightning.retained.shm import list_segments, unlink_segments
    from leto_lightning.testing.crash import run_in_child
    from leto_lightning.testing.scenario import CoreScenario

    monkeypatch.setenv("LETO_JOB_PREFIX", os.environ.get("LETO_JOB_PREFIX", "") + "e-15-")
    # made by a process that is gone (as a job's trainers are): nothing maps the segments any more
    job_id = run_in_child(lambda: CoreScenario(n_ranks=1).create_job().job_id).value
    try:
        assert "-" in job_id and list_segments(f"leto-{job_id}-")
        code, text = leto("cleanup", "--job", job_id)
        assert code == 0 and "freed" in text, text
        assert list_segments(f"leto-{job_id}-") == []
    finally:
        unlink_segments(job_id)
