"""The agent's checkpoint fallback with ``LetoAccelerator`` (``LETO_RESUME=checkpoint``): under
``leto launch``, after the checkpoint of step 4, both active trainers are stopped (SIGSTOP),
every data page of both ranks' retained stores is overwritten (beyond tier-1 and tier-2 parity)
and both are SIGKILLed. The agent finds the damage beyond parity, frees the retained state and
restarts every trainer with ``LETO_RESUME=checkpoint``; the unchanged script's
``leto_resume()`` loads the newest checkpoint every rank saved in this job (step 4) and the job
finishes: weights, AdamW state, LR and every logged loss bit-identical to plain
``accelerate.Accelerator`` running the loop without interruption.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from acc_job import (
    CONFIG,
    EPOCHS,
    QUIET,
    active_pid,
    all_events,
    assert_nothing_left,
    check_identical,
    finish,
    free_port,
    loss_rows,
    run,
    stop,
    wait_for,
)

SCRIPT = Path(__file__).with_name("acc_restart_train.py")
LOOP = ["--epochs", str(EPOCHS), "--save-every", "4"]  # 16 steps, checkpoints after 4, 8, 12, 16


def _wipe_data_pages(job_id: str) -> list[str]:
    """Overwrite every byte of the job's data segments (every rank's params, grads, AdamW state)."""
    wiped = sorted(glob.glob(f"/dev/shm/*{job_id}-r*-data"))
    for path in wiped:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(b"\xa5" * size)
    return wiped


@pytest.mark.slow  # LETO_LONG=1: about 2 minutes on 2 loaded cores (three launches)
def test_damage_beyond_parity_restarts_from_the_newest_save_state(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                "--main_process_port", str(free_port()), str(SCRIPT), *LOOP, "--plain", "--out", str(reference)],
               reference)
    assert done.returncode == 0, done.stdout[-4000:]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           str(SCRIPT), *LOOP, "--sleep", "0.2"]
    log = tmp_path / "leto.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=QUIET, stdout=f, stderr=subprocess.STDOUT)
    try:
        records = [run_dir / "accelerate" / f"checkpoints_rank{r}.json" for r in range(2)]
        wait_for(lambda: all(p.exists() for p in records) and len(loss_rows(run_dir)) > 5, 300,
                 "step 4's checkpoint recorded by both ranks, and step 5")
        (job_id,) = {e["job_id"] for e in all_events(run_dir) if e["event"] == "job_started"}
        victims = [active_pid(run_dir, r) for r in range(2)]
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)  # nothing rewrites a page while it is overwritten
        assert len(_wipe_data_pages(job_id)) == 2
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        output = finish(proc, log)
    finally:
        stop(proc)
    assert proc.returncode == 0, output[-5000:]
    events = all_events(run_dir)
    (fallback,) = [e for e in events if e["event"] == "fallback_checkpoint"]
    assert "damaged beyond what checksums, copies and parity can repair" in fallback["reason"], fallback
    assert not [e for e in events if e["event"] == "recovery_finished"]
    restarted = [e for e in events if e["event"] == "process_started" and e["role"] == "active"][-2:]
    assert [e.get("resume") for e in restarted] == ["checkpoint"] * 2
    assert {json.loads(p.read_text()).get("4") for p in records} == {str(run_dir / "checkpoints" / "step_4")}
    check_identical(run_dir, reference)
    rows = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    logged = [row["step"] for row in rows if "loss" in row]
    assert logged.count(1) == 1 and logged.count(5) == 2  # the restart redid the steps after step 4 only
    assert_nothing_left(run_dir)
