"""`leto launch` under abuse (issue 15 items 2, 3, 4, 10, 11, 12): real processes and signals,
gloo on CPU, 2 ranks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from leto_lightning.retained.shm import list_segments
from leto_lightning.runtime.events import EventLog, iter_events, read_events
from leto_lightning.runtime.storage import StorageError

from .harness import finish, launch_args, stop, wait_for

ITERATIONS = 12
SETUP = "setup.segments_created"  # a trainer's store segments exist, not yet initialised
NO_SHADOWS = ["--no-shadows"]  # where shadows play no part: half the processes to start


def _events(run_dir) -> list[dict]:
    return list(iter_events(run_dir))


def _check_breakdowns(result) -> None:
    for e in result.of("recovery_finished"):
        if not e.get("interrupted"):
            assert abs(sum(e["breakdown"].values()) - e["total_s"]) < 1e-3, e


def test_failure_during_setup_falls_back_at_once(tmp_path):
    """SIGKILL (an OOM kill) and SIGBUS (a too-small /dev/shm) after the store's segments exist but
    before it is complete: recognised as half-initialised, fresh start within seconds."""
    faults = [{"id": 0, "rank": 0, "point": SETUP, "generation": 0},
              {"id": 1, "rank": 1, "point": SETUP, "generation": 2, "signal": int(signal.SIGBUS)}]
    proc = subprocess.Popen(launch_args(tmp_path, ITERATIONS, faults=faults, extra=NO_SHADOWS),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = finish(proc, tmp_path, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    detected = result.of("failure_detected")
    assert [e["signal"] for e in detected] == [signal.SIGKILL, signal.SIGBUS], detected
    fallbacks = result.of("fallback_checkpoint")
    assert len(fallbacks) == 2, [e["event"] for e in result.events]
    for failure, fallback in zip(detected, fallbacks):
        assert "incomplete" in fallback["reason"] and "set-up" in fallback["reason"], fallback
        assert fallback["time"] - failure["time"] < 5, (failure, fallback)
    assert not result.of("recovery_finished")
    assert sum(1 for _ in open(tmp_path / "loss_rank0.jsonl")) == ITERATIONS


@pytest.mark.parametrize("case", ["cold_start", "fallback"])
def test_stop_request_to_the_process_group_wins_over_recovery(tmp_path, case):
    """What `timeout` and SLURM do: SIGTERM/SIGINT to the whole process group, at a random moment
    of a recovery. The job stops within 5 s, says so, and leaves no process and no memory."""
    rng = random.Random(int(os.environ.get("LETO_SEED", "0")) * 2 + (case == "fallback"))
    if case == "cold_start":  # no shadows: a cold start (process start-up) is the recovery
        faults, extra, sig = [{"id": 0, "rank": 1, "iteration": 3, "point": "compute.begin"}], ["--no-shadows"], \
            signal.SIGTERM
        marker = "recovery_started"
    else:  # a trainer dies during set-up: the recovery is a restart from scratch
        faults, extra, sig = [{"id": 0, "rank": 0, "point": SETUP}], NO_SHADOWS, signal.SIGINT
        marker = "fallback_checkpoint"
    proc = subprocess.Popen(launch_args(tmp_path, 200, faults=faults, extra=extra, script_args=["--sleep", "0.1"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: any(e["event"] == marker for e in _events(tmp_path)), 120, marker)
        time.sleep(rng.uniform(0.0, 2.0))
        sent = time.time()
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        took = time.time() - sent
    except BaseException:
        stop(proc)
        raise
    result = finish(proc, tmp_path)  # asserts: no process left, port closed
    assert result.returncode == 128 + sig, result.output[-3000:]
    assert took < 5, f"{took:.1f} s to stop"
    assert result.of("job_interrupted")[-1]["signal"] == sig
    assert not [e for e in result.of("classification") if e["time"] > sent], "a stop is not a failure to recover"
    assert not [e for e in result.of("recovery_started") if e["time"] > sent]
    for job in {e["job_id"] for e in result.events if e.get("job_id")}:
        assert list_segments(f"leto-{job}-") == [], "retained memory left behind"
    assert "Traceback" not in "\n".join(line for line in result.output.splitlines() if not line.startswith("[rank"))


def test_trainer_failing_twice_at_startup_is_a_configuration_error(tmp_path):
    proc = subprocess.Popen(launch_args(tmp_path, ITERATIONS, extra=NO_SHADOWS, script_args=["--dim", "sixty-four"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = finish(proc, tmp_path, timeout=240)
    assert result.returncode == 3, result.output[-3000:]
    (stopped,) = result.of("job_stopped")
    assert "configuration error" in stopped["reason"] and "sixty-four" in stopped["reason"], stopped
    assert len(result.of("failure_detected")) == 2


def test_stopped_shadow_is_not_promoted_and_the_right_rank_is_blamed(tmp_path):
    """A SIGSTOPped shadow: the recovery starts cold instead of waiting for it (item 11)."""
    proc = subprocess.Popen(launch_args(tmp_path, 24, script_args=["--sleep", "0.1"]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: any(e["event"] == "shadow_level" and e["reason"] == "ready" for e in _events(tmp_path)),
                 120, "ready shadows")
        shadow = [e["pid"] for e in _events(tmp_path) if e["event"] == "process_started" and e["role"] == "shadow"][1]
        active = next(e["pid"] for e in _events(tmp_path) if e["event"] == "process_started" and e["role"] == "active")
        os.kill(shadow, signal.SIGSTOP)
        os.kill(active, signal.SIGKILL)
    except BaseException:
        stop(proc)
        raise
    result = finish(proc, tmp_path, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    (failure,) = result.of("failure_detected")
    assert failure["pid"] == active and failure["rank"] == 0
    assert result.of("cold_start") and not result.of("shadows_promoted")
    (done,) = result.of("recovery_finished")
    assert done["promoted"] == "cold" and done["breakdown"]["start"] > 0  # process start-up is its own part
    _check_breakdowns(result)


def _tmpfs(path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "2M"):
        pytest.skip("mounting a small tmpfs needs root (the event log's ENOSPC handling is tested without one)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_full_run_dir_stops_the_job_with_the_reason(small_disk):
    """A 2 MiB filesystem: the first checkpoints (1 MiB per rank) do not fit. Not a HOF: the job
    stops, saying so; the event log is whole; `leto cleanup RUN_DIR` works afterwards."""
    from leto_lightning import cli

    run_dir = small_disk / "run"
    result = finish(subprocess.Popen(launch_args(run_dir, 30, extra=NO_SHADOWS), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True), run_dir, timeout=240)
    assert result.returncode == 3, result.output[-3000:]
    verdicts = result.of("classification")
    assert verdicts and not verdicts[0]["hof"] and "storage" in verdicts[0]["reason"], verdicts
    assert "No space left" in result.output and "job stopped" in result.output
    assert not result.of("recovery_started") and not result.of("fallback_checkpoint")
    raw = (run_dir / "events.jsonl").read_bytes()
    assert raw.endswith(b"\n") and all(json.loads(line) for line in raw.splitlines())
    assert not [n for n in os.listdir(run_dir / "checkpoints") if n.endswith(".tmp")]
    assert cli.main(["cleanup", str(run_dir)]) == 0


def test_event_log_on_a_full_disk_is_never_torn(tmp_path):
    disk = tmp_path / "disk"
    if _tmpfs(disk, "64k"):
        try:
            log = EventLog(disk)
            with pytest.raises(StorageError, match="event log"):
                for n in range(10_000):
                    log.emit("filler", 0, payload="x" * 500, n=n)
            log.close()
            raw = (disk / "events.jsonl").read_bytes()
            assert raw.endswith(b"\n") and len(read_events(disk)) == raw.count(b"\n")
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    else:  # no root: /dev/full answers every write with ENOSPC
        log = EventLog(tmp_path)
        log.emit("job_started", 0)
        os.dup2(os.open("/dev/full", os.O_WRONLY), log._fd)
        with pytest.raises(StorageError):
            log.emit("filler", 0)
        log.close()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "events.jsonl").write_text('{"event": "a", "generation": 0, "time": 1}\n{"event": "b", "ge')
    assert [e["event"] for e in read_events(tmp_path / "torn")] == ["a"]
