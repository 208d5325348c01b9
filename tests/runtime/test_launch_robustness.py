"""`leto launch` under abuse (issue 15 items 2, 3, 4, 10, 11, 12; issue 25 items 8, 9, 10): real
processes and signals, gloo on CPU, 2 ranks."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch

from leto_lightning import new_job_id
from leto_lightning.errors import SharedMemoryCapacityError
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import (
    SharedSegment,
    list_segments,
    segment_name,
    shm_free_bytes,
    unlink_segments,
)
from leto_lightning.retained.spec import StoreSpec
from leto_lightning.retained.store import RetainedStore
from leto_lightning.runtime.event_types import ColdStart, FallbackCheckpoint
from leto_lightning.runtime.events import EventLog, iter_events, read_events
from leto_lightning.runtime.storage import StorageError
from leto_lightning.updater.retained_optimizer import layout_for

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
                    log.write(FallbackCheckpoint(generation=0, reason=f"{n} " + "x" * 500))
            log.close()
            raw = (disk / "events.jsonl").read_bytes()
            assert raw.endswith(b"\n") and len(read_events(disk)) == raw.count(b"\n")
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    else:  # no root: /dev/full answers every write with ENOSPC
        log = EventLog(tmp_path)
        log.write(ColdStart(generation=0, reason="before"))
        os.dup2(os.open("/dev/full", os.O_WRONLY), log._fd)
        with pytest.raises(StorageError):
            log.write(ColdStart(generation=0, reason="filler"))
        log.close()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "events.jsonl").write_text('{"event": "a", "generation": 0, "time": 1}\n{"event": "b", "ge')
    assert [e["event"] for e in read_events(tmp_path / "torn")] == ["a"]


# -- issue 25 items 8, 9, 10: start-up failures said once, by kind, with their time ----------------

def _private_shm(size: str) -> list[str] | None:
    """A command prefix that runs its command with a ``size`` tmpfs of its own on /dev/shm (a
    private mount namespace: nothing else on the machine sees it, it goes with the command), or
    None where this machine cannot make one."""
    if shutil.which("unshare") is None:
        return None
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]  # else a user namespace maps us to its root
    probe = subprocess.run(["unshare", *flags, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", *flags, "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh"]


def test_a_too_small_dev_shm_stops_the_job_once_at_start(tmp_path):
    """/dev/shm of 3 MiB, two ranks whose stores need about 3.1 MiB together: without the check
    every start dies by SIGBUS at its first write (and restarts until the budget is spent). With
    it: the first trainer that cannot get its store says so, and the job stops, in one line."""
    prefix = _private_shm("3M")
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare): the check is tested against the real /dev/shm below")
    proc = subprocess.Popen(prefix + launch_args(tmp_path, ITERATIONS, extra=[*NO_SHADOWS, "--max-failures", "3"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = finish(proc, tmp_path, timeout=240)
    assert result.returncode == 3, result.output[-3000:]
    (detected,) = result.of("failure_detected")
    assert detected["exception"].startswith("SharedMemoryCapacityError: /dev/shm has"), detected
    (stopped,) = result.of("job_stopped")
    assert "MiB free" in stopped["reason"] and "--shm-size" in stopped["reason"], stopped
    assert not result.of("fallback_checkpoint") and not result.of("recovery_started")
    said = [line for line in result.output.splitlines() if line.startswith("[leto]") and "job stopped" in line]
    assert len(said) == 1 and "/dev/shm has" in said[0], result.output[-3000:]


def test_a_store_larger_than_free_dev_shm_is_refused_before_allocating():
    """The real /dev/shm, a store larger than its free space (``os.statvfs``): refused before a
    byte is allocated. The model is on the meta device: only its layout is needed."""
    free = shm_free_bytes()
    params = [torch.nn.Parameter(torch.empty(free // 8, device="meta"))]  # AdamW: 4 regions x 4 B per element
    config = RetainedConfig().for_device("cpu")
    spec = StoreSpec(new_job_id(), 0, 0, 0, 1, layout_for(torch.optim.AdamW(params), config), config)
    try:
        with pytest.raises(SharedMemoryCapacityError, match=r"/dev/shm has .* MiB free, rank 0's retained store "
                                                            r"needs .* MiB: enlarge it"):
            RetainedStore.create(spec)
        assert list_segments(segment_name(spec.job_id, "")) == []
        name = segment_name(spec.job_id, "r0", "data")
        with pytest.raises(SharedMemoryCapacityError, match=f"segment {name} needs"):
            SharedSegment.create(name, free + (1 << 30))
        assert list_segments(segment_name(spec.job_id, "")) == []
    finally:
        unlink_segments(spec.job_id)


STARTUP_FAILURES = {
    # the message holds a pid and a time: never the same text twice
    "exception": ("import os, time\nraise RuntimeError(f'data server refused pid {os.getpid()} at {time.time()}')\n",
                  "RuntimeError"),
    "sigsegv": ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "SIGSEGV"),
}


@pytest.mark.parametrize("case", sorted(STARTUP_FAILURES))
def test_the_same_kind_of_failure_twice_at_startup_stops_the_job(tmp_path, case):
    """Told apart by kind (signal, exception type), not by text; the reason names the last
    exception (the second trainer's pid)."""
    source, kind = STARTUP_FAILURES[case]
    script = tmp_path / "train.py"
    script.write_text(source)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(launch_args(run_dir, ITERATIONS, nproc=1, script=str(script),
                                        extra=[*NO_SHADOWS, "--max-failures", "5"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = finish(proc, run_dir, timeout=240)
    assert result.returncode == 3, result.output[-3000:]
    detected = result.of("failure_detected")
    assert len(detected) == 2, [e["event"] for e in result.events]
    (stopped,) = result.of("job_stopped")
    assert stopped["reason"].startswith(f"configuration error: the trainer failed the same way ({kind}) at start-up "
                                        "twice"), stopped
    if case == "exception":
        assert f"RuntimeError: data server refused pid {detected[1]['pid']} at" in stopped["reason"], stopped
        assert all(e["exception"].startswith("RuntimeError: data server refused") for e in detected), detected


def test_a_hang_at_startup_is_reported_as_detection_time(tmp_path):
    """A cold-started trainer stops (SIGSTOP) before it resumes: the agent detects the hang after
    --startup-timeout and recovers again. That recovery's breakdown counts the whole wait as
    ``detect`` (it was 0.05 s: since the last poll)."""
    timeout = 30.0
    faults = [{"id": 0, "rank": 1, "iteration": 3, "point": "compute.begin"},
              {"id": 1, "rank": 0, "point": "promotion.resume", "generation": 1, "signal": int(signal.SIGSTOP)}]
    proc = subprocess.Popen(launch_args(tmp_path, ITERATIONS, faults=faults,
                                        extra=[*NO_SHADOWS, "--startup-timeout", str(timeout)]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = finish(proc, tmp_path, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    hang = [e for e in result.of("failure_detected") if e["hang"]]
    assert [(e["rank"], e["generation"]) for e in hang] == [(0, 1)], result.of("failure_detected")
    (done,) = [e for e in result.of("recovery_finished") if not e.get("interrupted")]
    assert done["generation"] == 2 and done["breakdown"]["detect"] > timeout, done
    _check_breakdowns(result)
