"""An unchanged Lightning script (``examples/lightning_tiny.py``, ``Trainer(strategy="leto",
devices=2, accelerator="cpu")``) under ``leto launch --nproc-per-node 2``: real processes,
real SIGKILLs, gloo on CPU.

- fault-free, it is bit-identical to the same script under Lightning's own DDP (weights,
  optimizer state, every logged loss);
- HOFs at seeded random points -- mid-update, right after a checkpoint save, during
  validation, at an epoch boundary, on both ranks at once -- each recovered in place by
  promoting the shadows; weights, optimizer state and the CSVLogger loss series equal the
  fault-free run's, and the recovery metrics reach CSVLogger and wandb (offline);
- an active trainer SIGKILLed from outside (its pid from ``events.jsonl``): the same;
- a failure declared not a HOF: every rank restarts from the last checkpoint file: the same.

Runs take 15-90 s each (2 cores: four trainer processes start at once).
"""

from __future__ import annotations

import os
import signal

import pytest
from launch_job import (
    Run,
    ddp_reference,
    events,
    finish,
    free_port,
    launch,
    same_state,
    start,
    wait_for,
    wandb_groups,
    wandb_history,
)

from leto_lightning.faults.plan import planned_faults
from leto_lightning.testing.launched import stop


@pytest.fixture(autouse=True)
def _warm_template(monkeypatch) -> None:
    """Later trainers forked from the warm template (off by default in the suite: conftest)."""
    import launch_job

    monkeypatch.setitem(launch_job.QUIET, "LETO_WARM_TEMPLATE", "1")

STEPS = 40  # 10 batches per epoch and rank: epochs end after steps 9, 19, 29; validation every 5 batches;
# checkpoints (every 7 steps, plus last.ckpt) after steps 6, 13, 20, 27, 34


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """The fault-free run under ``leto launch`` every faulty run must match bit for bit."""
    run = launch(tmp_path_factory.mktemp("reference") / "run", STEPS, extra_script=["--wandb", "--tensorboard"])
    assert run.returncode == 0, run.output[-4000:]
    assert not run.of("failure_detected")
    return run


def test_fault_free_launch_equals_lightning_ddp(reference: Run, tmp_path) -> None:
    """No failure: LetoStrategy under leto launch trains exactly like Lightning's DDP."""
    ddp = ddp_reference(tmp_path / "ddp", STEPS)
    assert ddp.returncode == 0, ddp.output[-4000:]
    for rank in range(2):
        assert same_state(reference.final(rank), ddp.final(rank)) == [], f"rank {rank}"
    assert same_state(reference.final(0), reference.final(1)) == []  # DDP keeps the ranks equal
    series = reference.loss_series()
    assert series == ddp.loss_series()
    train = [float(s[2]) for s in series if s[2]]
    assert len(train) == STEPS  # one train_loss row per step
    assert train[-1] < train[0] - 0.5  # it learns
    assert "in-place recoveries: 0" in reference.output and "ETTR: 1.0000" in reference.output
    assert {e["event"] for e in reference.events} >= {"job_started", "shadow_level", "job_finished"}


def _hof_faults(seed: int) -> list[dict]:
    """Five HOFs at seeded random occurrences; each strikes once a fresh shadow set is ready."""
    plan = [  # (ranks, point, iterations, occurrences per iteration)
        ([1], "chunk.math_done", (2, 4), 7),  # mid-update (7 chunks per step with 16 KiB pages)
        ([0], "lightning.after_checkpoint", (13, 13), 2),  # right after a save (step-14 file, then last.ckpt)
        ([1], "lightning.validation", (24, 24), 2),  # during a mid-epoch validation
        ([0], "lightning.epoch_end", (29, 29), 1),  # at an epoch boundary
        ([0, 1], "chunk.tier2_partial", (33, 36), 4),  # both ranks at once, mid-parity-update
    ]
    return planned_faults(plan, seed)


def test_hofs_at_random_points_bit_identical_with_metrics(reference: Run, tmp_path) -> None:
    faults = _hof_faults(seed=int(os.environ.get("LETO_SEED", "0")))
    run = launch(tmp_path / "run", STEPS, faults=faults, extra_script=["--wandb", "--tensorboard"])
    assert run.returncode == 0, run.output[-4000:]
    finished = [e for e in run.of("recovery_finished") if not e.get("interrupted")]
    assert len(finished) == 5, [(e["event"], e.get("reason")) for e in run.events]
    assert all(e["promoted"] == "shadow" for e in finished)
    assert not run.of("fallback_checkpoint") and not run.of("cold_start")
    assert [e["signal"] for e in run.of("failure_detected")] == [signal.SIGKILL] * 5
    for e in finished:  # at most the interrupted step is recomputed
        assert e["resume_iteration"] >= e["failed_iteration"]
        assert e["breakdown"]["init"] < 0.5  # a level-3 shadow waits fully built
    for rank in range(2):
        assert same_state(run.final(rank), reference.final(rank)) == [], f"rank {rank}"
    assert run.loss_series() == reference.loss_series()  # CSVLogger: every loss, once, in order
    # TensorBoard: the promoted shadows' event files purge what a dead trainer logged past its payload
    series = run.tensorboard("train_loss", "val_loss")
    assert series == reference.tensorboard("train_loss", "val_loss") and len(series["train_loss"]) == STEPS

    # the recovery metrics: one CSV row per recovery, and the summary table
    rows = run.recovery_rows()
    assert [float(r["leto/recovery/generation"]) for r in rows] == [float(e["generation"]) for e in finished]
    assert [float(r["leto/hof_count"]) for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    for row, event in zip(rows, finished):
        assert float(row["leto/recovery/total_s"]) == pytest.approx(event["total_s"])
        assert float(row["leto/recovery/detect_s"]) == pytest.approx(event["breakdown"]["detect"])
        assert float(row["leto/recovery/resume_iteration"]) == event["resume_iteration"]
        it = event["resume_iteration"]  # a restart from the newest file (every 7 steps) would redo these
        # ... unless the HOF struck after rank 0 saved last.ckpt at the validation's end (save_last): then
        # that file is at `it` and a restart would redo nothing -- whether rank 0 got there before the
        # agent stopped it is a race, so both values are right
        assert float(row["leto/recovery/kept_iterations"]) in {it - 7 * (it // 7), 0.0}
        assert 0.0 < float(row["leto/ettr"]) < 1.0
    assert float(rows[-1]["leto/recovered_iterations"]) > 0
    assert "in-place recoveries: 5" in run.output and "HOFs: 5" in run.output

    # wandb (offline): the runs of the processes that logged them hold the same metrics
    assert wandb_groups(run.run_dir) == {"leto-run"}  # one run per trainer process, one group per job
    history = [row for rows_ in wandb_history(run.run_dir).values() for row in rows_]
    logged = [row for row in history if "leto/recovery/total_s" in row]
    assert sorted(row["leto/recovery/generation"] for row in logged) == [e["generation"] for e in finished]
    assert max(row["leto/hof_count"] for row in logged) == 5
    expected = {int(s[0]): float(s[2]) for s in reference.loss_series() if s[2]}
    wandb_losses = {row["trainer/global_step"]: row["train_loss"] for row in history if "train_loss" in row}
    assert all(wandb_losses[step] == expected[step] for step in wandb_losses)
    # a SIGKILLed trainer may lose wandb's last second of history; the last process loses nothing
    assert all(step in wandb_losses for step in expected if step >= finished[-1]["resume_iteration"])


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_external_sigkill_of_an_active_trainer(reference: Run, tmp_path) -> None:
    """Someone else kills an active trainer (found through events.jsonl): recovered in place."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = start(run_dir, STEPS, extra_script=["--sleep", "0.15"])
    try:
        metrics = run_dir / "csv" / "version_0" / "metrics.csv"
        wait_for(lambda: any(e["event"] == "shadow_level" and e.get("reason") == "ready" for e in events(run_dir))
                 and metrics.exists() and sum(1 for _ in open(metrics)) > 8, 150, "shadows ready and step 8")
        victim = [e["pid"] for e in events(run_dir) if e["event"] == "process_started" and e["role"] == "active"
                  and e["rank"] == 1][-1]
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    run = finish(proc, run_dir)
    assert run.returncode == 0, run.output[-4000:]
    (failure,) = run.of("failure_detected")
    assert failure["pid"] == victim and failure["signal"] == signal.SIGKILL
    (done,) = run.of("recovery_finished")
    assert done["promoted"] == "shadow"
    for rank in range(2):
        assert same_state(run.final(rank), reference.final(rank)) == [], f"rank {rank}"
    assert run.loss_series() == reference.loss_series()
    assert len(run.recovery_rows()) == 1


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_non_hof_failure_restarts_from_the_last_checkpoint_file(reference: Run, tmp_path) -> None:
    """A failure declared not a HOF: every trainer restarts with LETO_RESUME=checkpoint and the
    script's fit(ckpt_path="last") resumes from the file saved after step 20 -- bit-identical,
    with the same CSV loss series (the file carries the Leto payload: RNG, data position, rows)."""
    faults = [{"id": 0, "rank": 1, "iteration": 23, "point": "compute.begin", "action": "exit", "code": 43}]
    run = launch(tmp_path / "run", STEPS, faults=faults, launch_extra=["--non-hof-exit-code", "43"])
    assert run.returncode == 0, run.output[-4000:]
    (verdict,) = run.of("classification")
    assert verdict["hof"] is False
    assert len(run.of("fallback_checkpoint")) == 1 and not run.of("recovery_finished")
    assert [e.get("resume") for e in run.of("process_started") if e["role"] == "active"][-2:] == ["checkpoint"] * 2
    for rank in range(2):
        assert same_state(run.final(rank), reference.final(rank)) == [], f"rank {rank}"
    assert run.loss_series() == reference.loss_series()
    assert "checkpoint restarts: 1" in run.output
    import torch

    files = sorted((tmp_path / "run").rglob("*.ckpt"))
    assert files, "the job wrote no checkpoint file"
    for path in files:  # under leto launch too (the payload carries the loggers' state): data only
        assert torch.load(path, weights_only=True)["callbacks"]["LetoLoopStateCallback"]["payload"]["logs"], path


# -- without launching anything -------------------------------------------------------------------
def _trainer(devices: int):
    import lightning.pytorch as pl

    return pl.Trainer(strategy="leto", devices=devices, accelerator="cpu", logger=False, enable_progress_bar=False)


_RANK_ENV = ("LETO_ROLE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "GROUP_RANK", "NODE_RANK", "LETO_NO_SUPERVISE")


@pytest.fixture
def clean_env(monkeypatch):
    for key in [*_RANK_ENV, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_launchers_that_kill_every_rank_are_refused_at_trainer(clean_env) -> None:
    """Lightning's launcher (`python train.py` with devices=2), torchrun and srun stop every rank
    when one dies. From a script file the process becomes the supervisor (tested with real
    launches in test_lightning_python_launch.py and test_lightning_torchrun.py); here, inside
    pytest (no script file to re-run), each is refused when the Trainer is built, saying what
    to do."""
    with pytest.raises(RuntimeError, match=r"does not start ranks.*`leto launch --nproc-per-node 2 "):
        _trainer(2)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        clean_env.setenv(key, value)
    with pytest.raises(RuntimeError, match=r"under torchrun: each rank's process becomes that rank's Leto agent.*"
                                           r"`torchrun \.\.\. train\.py` \(not with -m"):
        _trainer(2)
    with pytest.raises(RuntimeError, match=r"torchrun started 2 ranks, 2 per node, but the Trainer asks for "
                                           r"devices=4 x num_nodes=1.*--nproc-per-node"):
        _trainer(4)
    for key in _RANK_ENV:
        clean_env.setenv(key, "")  # recorded: Lightning's SLURMEnvironment sets MASTER_ADDR/MASTER_PORT
        clean_env.delenv(key)
    for key, value in dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_PROCID="1",
                           SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_JOB_ID="1234", SLURM_JOB_NAME="train",
                           SLURM_NODELIST="node[3-4]").items():
        clean_env.setenv(key, value)
    with pytest.raises(RuntimeError, match=r"under srun: each rank's process.*`srun python train\.py`"):
        _trainer(2)
    clean_env.setenv("SLURM_PROCID", "0")  # local rank 1 on node 0 must be rank 1
    with pytest.raises(RuntimeError, match=r"srun made rank 0 local rank 1 on node 0.*--distribution=block"):
        _trainer(2)


def test_trainer_devices_must_match_leto_launch(clean_env) -> None:
    for key, value in dict(LETO_ROLE="active", RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
                           MASTER_PORT="1").items():
        clean_env.setenv(key, value)
    with pytest.raises(ValueError, match=r"asks for 2 ranks.*WORLD_SIZE=4.*--nproc-per-node \(4\)"):
        _trainer(2)
    trainer = _trainer(4)  # nothing connects before fit()
    assert type(trainer.strategy.cluster_environment).__name__ == "LetoEnvironment"
    assert trainer.strategy.cluster_environment.creates_processes_externally


def test_recovery_metrics_and_summary_from_events() -> None:
    from leto_lightning.integrations.lightning.recovery_metrics import metrics_for, summary_table
    from leto_lightning.runtime.event_types import RecoveryFinished, from_record

    t0 = 1000.0
    events = [from_record(record) for record in [
        {"time": t0, "event": "job_started", "generation": 0},
        {"time": t0 + 10, "event": "classification", "generation": 0, "hof": True},
        {"time": t0 + 11, "event": "recovery_finished", "generation": 1, "total_s": 1.0, "first_iteration_s": 0.2,
         "resume_iteration": 12, "failed_iteration": 11, "promoted": "shadow",
         "breakdown": {"detect": 0.1, "stop": 0.1, "attach_repair": 0.2, "init": 0.0, "resume": 0.3, "recompute": 0.1}},
        {"time": t0 + 30, "event": "classification", "generation": 1, "hof": True},
        {"time": t0 + 31, "event": "recovery_finished", "generation": 2, "interrupted": True, "breakdown": {},
         "resume_iteration": 20, "failed_iteration": 20},
    ]]
    assert isinstance(events[2], RecoveryFinished)
    m = metrics_for(events[2], events, kept_iterations=5, recovered_before=3)
    assert m["leto/recovery/total_s"] == 1.0 and m["leto/recovery/resume_s"] == 0.3
    assert m["leto/hof_count"] == 1 and m["leto/recoveries"] == 1
    assert m["leto/recovered_iterations"] == 8 and m["leto/recovery/kept_iterations"] == 5
    assert m["leto/ettr"] == pytest.approx(1 - 1.0 / 11)
    table = summary_table(events, now=t0 + 40)
    assert "HOFs: 2" in table and "in-place recoveries: 1" in table and "interrupted" in table
    assert "ETTR: 0.9750" in table


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_two_node_agents_recover_a_lightning_job_in_lockstep(reference: Run, tmp_path, monkeypatch) -> None:
    """Two `leto launch` node agents (loopback), one rank each, `Trainer(num_nodes=2,
    devices=1)`: a HOF on node 1 mid-update is recovered on both nodes through the store;
    bit-identical to the one-node fault-free run (same global ranks and data)."""
    import launch_job

    port = free_port()
    # separate run dirs: every node gets the job's secret (in QUIET, the launches' environment:
    # it is copied from os.environ at import, so monkeypatch.setenv would not reach node 1)
    monkeypatch.setitem(launch_job.QUIET, "LETO_SECRET", os.urandom(16).hex())
    # one intra-op thread per trainer, as the one-node reference's 2 processes per node get (torchrun's
    # rule; with one process per node Lightning would use every CPU, and another thread count
    # changes the float reductions)
    monkeypatch.setitem(launch_job.QUIET, "OMP_NUM_THREADS", "1")
    faults = [{"id": 0, "rank": 1, "iteration": 11, "point": "chunk.math_done", "occurrence": 3,
               "wait_shadows": True}]
    procs = []
    for node in (0, 1):
        run_dir = tmp_path / f"node{node}"
        run_dir.mkdir()
        extra = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--nproc-per-node", "1"]
        procs.append(start(run_dir, STEPS, faults=faults, launch_extra=extra,
                           extra_script=["--devices", "1", "--num-nodes", "2"]))
    try:
        runs = [finish(p, tmp_path / f"node{n}") for n, p in enumerate(procs)]
    finally:
        for p in procs:
            stop(p)
    for run in runs:
        assert run.returncode == 0, run.output[-4000:]
        (done,) = run.of("recovery_finished")
        assert done["promoted"] == "shadow" and done["resume_iteration"] == 12
    for rank in range(2):
        assert same_state(runs[rank].final(rank), reference.final(rank)) == [], f"rank {rank}"
    assert runs[0].loss_series() == reference.loss_series()


@pytest.mark.slow  # LETO_LONG=1
def test_a_spare_node_takes_over_a_lost_lightning_node(reference: Run, tmp_path, monkeypatch) -> None:
    """`leto launch --nnodes 2 --spares 1` on three node agents (loopback), one rank each,
    `Trainer(num_nodes=2, devices=1)`: node 1 is lost whole (agent and trainers SIGKILLed, its
    retained memory unlinked) between checkpoints; the spare takes over with rank 1's state
    from rank 0's replica; bit-identical to the one-node fault-free run, losses included."""
    import glob

    import launch_job

    port = free_port()
    monkeypatch.setitem(launch_job.QUIET, "LETO_SECRET", os.urandom(16).hex())  # see the two-node case
    monkeypatch.setitem(launch_job.QUIET, "OMP_NUM_THREADS", "1")
    procs = []
    for node in range(3):
        run_dir = tmp_path / f"node{node}"
        run_dir.mkdir()
        extra = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--nproc-per-node", "1",
                 "--spares", "1", "--node-timeout", "3"]
        procs.append(start(run_dir, STEPS, launch_extra=extra, extra_script=["--devices", "1", "--num-nodes", "2"],
                           new_session=True))
    try:
        wait_for(lambda: bool(glob.glob(str(tmp_path / "node0" / "lightning_checkpoints" / "*step=14*"))), 240,
                 "the checkpoint after step 14")
        node1 = next(e for e in events(tmp_path / "node1") if e["event"] == "job_started")
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].communicate()
        for segment in glob.glob(f"/dev/shm/leto-{node1['job_id']}*"):
            os.unlink(segment)
        node0, spare = finish(procs[0], tmp_path / "node0"), finish(procs[2], tmp_path / "node2")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    for run in (node0, spare):
        assert run.returncode == 0, run.output[-4000:]
    assert [e["spare"] for e in node0.of("node_lost")] == [2]
    (received,) = spare.of("state_transferred")
    assert received["problem"] is None and received["pages_verified"] > 0
    assert same_state(node0.final(0), reference.final(0)) == []
    assert same_state(spare.final(1), reference.final(1)) == []
    assert node0.loss_series() == reference.loss_series()


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_16_mixed_with_hofs_equals_lightning_ddp(tmp_path) -> None:
    """fp16 with a GradScaler (overflowing, backing off, growing) under `leto launch`: HOFs
    mid-update and inside the epoch-end validation; the promoted shadows continue with the
    scaler's state and run that validation again; bit-identical to the same script under
    Lightning's DDP, validation rows included."""
    steps = 20
    faults = [{"id": 0, "rank": 1, "iteration": 4, "point": "chunk.math_done", "occurrence": 3, "wait_shadows": True},
              {"id": 1, "rank": 0, "point": "lightning.validation", "occurrence": 3, "wait_shadows": True}]
    run = launch(tmp_path / "run", steps, faults=faults, extra_script=["--precision", "16-mixed"])
    assert run.returncode == 0, run.output[-4000:]
    finished = [e for e in run.of("recovery_finished") if not e.get("interrupted")]
    assert [e["promoted"] for e in finished] == ["shadow", "shadow"], run.output[-4000:]
    # kept_iterations: global steps since the newest checkpoint file (every 7 steps) -- global
    # steps, not retained iterations: a step the scaler skipped commits nothing
    rows = run.recovery_rows()
    assert len(rows) == 2
    for row in rows:
        step = int(float(row["leto/recovery/resume_step"]))
        assert step >= float(row["leto/recovery/resume_iteration"])
        assert float(row["leto/recovery/kept_iterations"]) == step - 7 * (step // 7), row
    assert any(float(r["leto/recovery/resume_step"]) > float(r["leto/recovery/resume_iteration"]) for r in rows)
    ddp = ddp_reference(tmp_path / "ddp", steps, "--precision", "16-mixed")
    assert ddp.returncode == 0, ddp.output[-4000:]
    for rank in range(2):
        assert same_state(run.final(rank), ddp.final(rank)) == [], f"rank {rank}"
    assert run.loss_series() == ddp.loss_series()
