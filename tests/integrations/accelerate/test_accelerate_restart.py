"""A ``LetoAccelerator`` job stopped and restarted from its ``save_state`` checkpoint, a SIGKILL
during evaluation, and the recovery metrics in Accelerate's trackers -- one end-to-end case
under ``accelerate launch --config_file configs/accelerate/leto.yaml`` (CPU, gloo, 2 ranks).

Job A (the exact mode, wandb offline and TensorBoard): rank 0's trainer is SIGKILLed inside the
evaluation that follows step 3 (its second batch, under ``torch.no_grad()``); its shadow is
promoted and redoes the step with its evaluation. After the checkpoint of step 4 the whole job
is stopped (SIGTERM to ``accelerate launch``: a preemption). Job B (a new job, the default
mode) calls ``load_state`` on that checkpoint after ``prepare()`` and ``leto_resume()``; rank
1's trainer is SIGKILLed after B's first step (a recovery from the store ``load_state``
re-initialised) and the job finishes. Final weights, optimizer state, LR and every logged loss and evaluation loss are
bit-identical to plain ``accelerate.Accelerator`` running the same loop without interruption;
job A's wandb runs are one group and hold the recovery metrics, as does its one TensorBoard
run directory.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from acc_job import (
    CONFIG,
    QUIET,
    ROOT,
    Killer,
    agent_events,
    all_events,
    assert_nothing_left,
    finals,
    finish,
    free_port,
    run,
    same_state,
    stop,
    wait_for,
)

sys.path.insert(0, str(ROOT / "tests" / "integrations" / "lightning"))
from launch_job import wandb_groups, wandb_history

SCRIPT = Path(__file__).with_name("acc_restart_train.py")
LOOP = ["--epochs", "2", "--eval-every", "3", "--save-every", "4"]  # 8 steps; evaluations after 3, 6
RECOVERY_FIELDS = {"leto/recovery/total_s", "leto/recovery/detect_s", "leto/recovery/shadow_level",
                   "leto/recovery/resume_iteration", "leto/recovery/kept_iterations", "leto/recoveries",
                   "leto/ettr"}


def _cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
            "--main_process_port", str(port), str(SCRIPT), *LOOP, *args]


def _rows(out: Path) -> dict[tuple[int, str], float]:
    """{(step, key): value} of the loss and evaluation rows (a redone step logs again: the last counts)."""
    rows: dict[tuple[int, str], float] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in ("loss", "lr", "eval_loss"):
            if key in row:
                rows[row["step"], key] = row[key]
    return rows


def _recovery_rows(cwd: Path) -> list[dict]:
    return [row for rows in wandb_history(cwd).values() for row in rows if "leto/recovery/total_s" in row]


def _scalars(directory: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_checkpoint_restart_and_a_kill_during_evaluation(tmp_path: Path) -> None:
    reference, out = tmp_path / "reference", tmp_path / "out"
    reference.mkdir()
    with open(tmp_path / "reference.log", "w") as f:  # beside job A, which mostly waits: CI time
        plain = subprocess.Popen(_cmd(free_port(), "--plain", "--out", str(reference)), cwd=reference, env=QUIET,
                                 stdout=f, stderr=subprocess.STDOUT)
    try:
        run_a = _job_a(tmp_path, out)
        _job_b(tmp_path, out, run_a)
        assert plain.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-4000:]
    finally:
        stop(plain)
    for rank, (mine, ref) in enumerate(zip(finals(out), finals(reference))):
        assert same_state(mine, ref) == [], f"rank {rank}"
    assert _rows(out) == _rows(reference)
    assert len(_rows(reference)) == 8 * 2 + 2
    _check_trackers(tmp_path, out, run_a)


def _job_a(tmp_path: Path, out: Path) -> Path:
    """Exact mode, wandb and TensorBoard; a kill inside the evaluation after step 3; SIGTERM
    once step 4's checkpoint is written. Returns its run directory."""
    fault = {"id": "eval", "rank": 0, "point": "compute.begin", "iteration": 3, "occurrence": 2,
             "wait_shadows": True}  # iteration 3's first two batches are the evaluation's
    env = dict(QUIET, LETO_FAULTS=json.dumps([fault]))
    log = tmp_path / "a.log"
    with open(log, "w") as f:
        job_a = subprocess.Popen(_cmd(free_port(), "--rollback-window", "--wandb", "--tensorboard", "--sleep", "0.2",
                                      "--slow-after", "4", "--out", str(out)),
                                 cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    step_4 = out / "checkpoints" / "step_4"
    try:
        wait_for(lambda: len(list((tmp_path / "leto-runs").glob("accelerate-*"))) == 1, 120, "job A's run dir")
        (run_a,) = (tmp_path / "leto-runs").glob("accelerate-*")
        killer = Killer(run_a, out, seed=0)
        wait_for(lambda: killer.recoveries() >= 1, 300, "the recovery from the kill during evaluation")
        # wandb writes its offline run file late on a loaded machine: look before step 4 ends, and
        # the job runs slower after it (--slow-after) so that it is still running then
        wait_for(lambda: _recovery_rows(tmp_path), 60, "the recovery metrics in wandb's run file")
        wait_for(lambda: all((step_4 / f"leto_state_{r}.pt").exists() for r in range(2)), 300, "step 4's checkpoint")
        job_a.send_signal(signal.SIGTERM)  # the whole job stops (preempted)
        output = finish(job_a, log, timeout=120)
    finally:
        stop(job_a)
    assert job_a.returncode != 0, output[-3000:]
    assert not (out / "final_rank0.pt").exists(), "job A ran to its end before it was stopped"
    failed = [e for e in all_events(run_a) if e["event"] == "failure_detected" and e["pid"]]
    assert [e["signal"] for e in failed if e["signal"] == signal.SIGKILL] == [signal.SIGKILL], failed
    assert all(len([e for e in log if e["event"] == "recovery_finished"]) == 1 for log in agent_events(run_a).values())
    assert_nothing_left(run_a)
    return run_a


def _job_b(tmp_path: Path, out: Path, run_a: Path) -> None:
    """A new job from step 4's checkpoint; a kill right after its first step, on the store
    load_state re-initialised (no evaluation follows that step: the default mode redoes none)."""
    after_load = {"id": "after-load", "rank": 1, "point": "accelerate.after_step", "iteration": 4,
                  "wait_shadows": True}
    job_b = run(_cmd(free_port(), "--load-state", str(out / "checkpoints" / "step_4"), "--out", str(out)), tmp_path,
                env=dict(QUIET, LETO_FAULTS=json.dumps([after_load])))
    assert job_b.returncode == 0, job_b.stdout[-4000:]
    (run_b,) = [d for d in (tmp_path / "leto-runs").glob("accelerate-*") if d != run_a]
    finished = [e for log in agent_events(run_b).values() for e in log if e["event"] == "recovery_finished"]
    assert len(finished) == 2 and all(e["promoted"] == "shadow" for e in finished), finished
    assert_nothing_left(run_b)


def _check_trackers(tmp_path: Path, out: Path, run_a: Path) -> None:
    """Job A's recovery in its trackers: wandb (one group over the original and the promoted
    main process) and TensorBoard (one run directory, one event file per main process)."""
    history = wandb_history(tmp_path)
    assert len(history) == 2 and wandb_groups(tmp_path) == {f"leto-{run_a.name}"}, (history.keys(),)
    logged = _recovery_rows(tmp_path)
    assert len(logged) == 1 and set(logged[0]) >= RECOVERY_FIELDS, logged
    # no checkpoint before the kill: a restart would have redone every step up to the resumed one
    assert logged[0]["leto/recovery/kept_iterations"] == logged[0]["leto/recovery/resume_iteration"] > 0
    board = out / "accelerate_train"
    assert len(list(board.glob("events.out.tfevents.*"))) >= 2
    scalars = _scalars(board)
    assert set(scalars) >= RECOVERY_FIELDS and len(scalars["leto/recovery/total_s"]) == 1, sorted(scalars)
