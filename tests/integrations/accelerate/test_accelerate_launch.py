"""``LetoAccelerator`` end to end: the unchanged example (``examples/accelerate_train.py``: the
compact MoE model, AdamW, a cosine schedule, accumulation 4, clipping, dropout, a shuffled
loader, a tracker) started by ``accelerate launch --config_file configs/accelerate/leto.yaml``,
by ``leto launch`` and by ``torchrun``, on CPU/gloo with 2 ranks. Each launch's final weights,
optimizer state, LR and logged losses equal plain ``accelerate.Accelerator``'s under the same
``accelerate launch`` command, bit for bit -- fault-free and with trainers SIGKILLed (from
outside at random moments and at chosen points inside an update, between steps and mid
accumulation), including both ranks at once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from acc_job import (
    EPOCHS,
    QUIET,
    SCRIPT,
    Killer,
    accelerate_cmd,
    agent_events,
    all_events,
    assert_nothing_left,
    check_identical,
    finish,
    free_port,
    run,
    stop,
    wait_for,
)


@pytest.fixture(autouse=True)
def _warm_template(monkeypatch) -> None:
    """Later trainers forked from the warm template (off by default in the suite: conftest)."""
    import acc_job

    monkeypatch.setitem(acc_job.QUIET, "LETO_WARM_TEMPLATE", "1")


SLEEP = ["--sleep", "0.35"]  # per micro-step: recoveries (shadows re-imported) fit in the run


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Plain ``accelerate.Accelerator`` under the same ``accelerate launch`` command."""
    out = tmp_path_factory.mktemp("reference")
    done = run(accelerate_cmd(free_port(), "--plain", "--ema", "--out", str(out)), out)
    assert done.returncode == 0, done.stdout[-4000:]
    return out


def _fault(fid: str, rank: int, where: str, iteration: int, occurrence: int = 1) -> dict:
    return {"id": fid, "rank": rank, "point": where, "iteration": iteration, "occurrence": occurrence,
            "wait_shadows": True}


def _run_dirs(cwd: Path, port: int) -> list[Path]:
    return sorted((cwd / "leto-runs").glob(f"accelerate-*-{port}"))


def _check_failures(run_dir: Path, kills: list[list[int]], n: int) -> None:
    """``n`` in-place recoveries on every agent (promoting the shadows, or -- a kill from outside
    before the new shadows are ready -- new trainers on the retained state); every kill from
    outside detected as a SIGKILL of its victim (of one of them, for ranks killed at once: the
    agents then recover both in one go); nothing left running or listening."""
    failed = {e["pid"]: e for e in all_events(run_dir) if e["event"] == "failure_detected" and e["pid"]}
    assert all(e["signal"] == signal.SIGKILL for e in failed.values()), failed
    for pids in kills:
        assert set(pids) & set(failed), (pids, sorted(failed))
    for rank, log in agent_events(run_dir).items():  # every agent recovered each time, in place
        finished = [e for e in log if e["event"] == "recovery_finished"]
        assert len(finished) == n and all(e["promoted"] in ("shadow", "cold") for e in finished), (rank, finished)
        # the injected faults wait for a ready shadow set: those recoveries promote it
        assert sum(e["promoted"] == "shadow" for e in finished) >= n - len(kills), (rank, finished)
    assert_nothing_left(run_dir)


def test_accelerate_launch_fault_free_then_five_kills_on_the_same_port(reference: Path, tmp_path) -> None:
    """Two jobs one after the other on one port: the first fault-free, the second with three
    SIGKILLs at chosen points (inside an update, after a step before the loop's scheduler step,
    in the middle of an accumulation) and two from outside at random moments (both ranks at
    once, then one rank). Both exit 0, bit-identical to plain Accelerate, in separate run dirs."""
    port = free_port()
    first = run(accelerate_cmd(port), tmp_path)
    assert first.returncode == 0, first.stdout[-4000:]
    assert "LetoAccelerator under accelerate: each rank becomes its own supervisor" in first.stdout
    (run_dir,) = _run_dirs(tmp_path, port)
    check_identical(run_dir, reference)
    _check_failures(run_dir, [], 0)

    faults = [_fault("update", 1, "chunk.math_done", 2), _fault("between", 0, "accelerate.after_step", 3),
              _fault("accumulation", 1, "compute.begin", 5, occurrence=2)]
    env = dict(QUIET, LETO_FAULTS=json.dumps(faults))
    log = tmp_path / "second.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(accelerate_cmd(port, "--sleep", "0.4"), cwd=tmp_path, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(_run_dirs(tmp_path, port)) == 2, 120, "the second job's run dir")
        second = next(d for d in _run_dirs(tmp_path, port) if d != run_dir)
        killer = Killer(second, second, seed=13)
        wait_for(lambda: killer.recoveries() >= 3, 300, "the three injected faults' recoveries")
        killer.kill((0, 1), after_step=6)
        killer.kill((1,), after_step=9)
        output = finish(proc, log)
    finally:
        stop(proc)
    assert proc.returncode == 0, output[-5000:]
    # shadows wait through the whole job without c10d's "waitForInput ... timed out" lines
    # (a store wait that times out logs two; waiting shadows poll instead)
    assert not [line for line in (first.stdout + output).splitlines() if "waitForInput" in line]
    check_identical(second, reference)
    _check_failures(second, killer.kills, 5)
    assert len({e["job_id"] for e in all_events(second) if e["event"] == "job_started"}) == 1


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_leto_launch_exact_mode_with_an_ema_after_the_step(reference: Path, tmp_path) -> None:
    """``LetoConfig(rollback_window=True)``: an EMA updated after ``opt.step()`` (user code the
    default mode does not replay) survives a kill right after a step and one mid-accumulation,
    and one from outside: weights, optimizer state, LR, losses and the EMA bit-identical."""
    run_dir = tmp_path / "run"
    faults = [_fault("between", 1, "accelerate.after_step", 4), _fault("accumulation", 0, "compute.begin", 9, 3)]
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--faults", json.dumps(faults), str(SCRIPT), "--epochs", str(EPOCHS), "--ema", "--rollback-window",
           *SLEEP]
    log = tmp_path / "leto.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=QUIET, stdout=f, stderr=subprocess.STDOUT)
    try:
        killer = Killer(run_dir, run_dir, seed=7)
        wait_for(lambda: killer.recoveries() >= 2, 300, "the injected faults' recoveries")
        killer.kill((1,), after_step=11)
        output = finish(proc, log)
    finally:
        stop(proc)
    assert proc.returncode == 0, output[-5000:]
    check_identical(run_dir, reference, ema=True)
    _check_failures(run_dir, killer.kills, 3)


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_torchrun_ranks_become_agents_and_recover(reference: Path, tmp_path) -> None:
    """``torchrun --standalone --nproc-per-node 2``: one kill inside an update, one from outside."""
    run_dir = tmp_path / "run"
    env = dict(QUIET, LETO_RUN_DIR=str(run_dir), LETO_FAULTS=json.dumps([_fault("update", 0, "chunk.begin", 5)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--epochs", str(EPOCHS), *SLEEP]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        killer = Killer(run_dir, run_dir, seed=3)
        wait_for(lambda: killer.recoveries() >= 1, 300, "the injected fault's recovery")
        killer.kill((1,), after_step=10)
        output = finish(proc, log)
    finally:
        stop(proc)
    assert proc.returncode == 0, output[-5000:]
    assert "LetoAccelerator under torchrun: each rank becomes its own supervisor" in output
    check_identical(run_dir, reference)
    _check_failures(run_dir, killer.kills, 2)
