"""The unchanged Lightning example (``Trainer(strategy="leto", devices=2)``) started by torchrun
and by srun (two processes with SLURM's variables: srun is not installed here). Each process the
launcher starts becomes its rank's Leto agent (exec), runs that rank's active and shadow
trainers, and recovers a trainer SIGKILLed from outside in place: torchrun never sees a rank die.
Final weights, optimizer state and the CSV loss series equal a fault-free run's bit for bit.

Runs take 25-60 s each on 2 shared cores (four trainer processes import Lightning at once).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from launch_job import QUIET, Run, assert_nothing_left, ddp_reference, same_state, script_args, wait_for

from leto_lightning.runtime.events import read_events

STEPS = 24  # epochs of 10 batches per rank; validation every 5 batches; checkpoints after steps 6, 13, 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """Fault-free, Lightning's own DDP with ranks started by hand (bit-identical to ``leto
    launch``: test_lightning_launch.py::test_fault_free_launch_equals_lightning_ddp)."""
    run = ddp_reference(tmp_path_factory.mktemp("reference") / "run", STEPS)
    assert run.returncode == 0, run.output[-4000:]
    return run


def _agent_events(run_dir: Path) -> dict[int, list[dict]]:
    """{rank: its agent's events}: rank 0's agent writes the job's events.jsonl, rank r's
    agents/rank<r>/events.jsonl."""
    logs = {0: read_events(run_dir)}
    for sub in sorted((run_dir / "agents").glob("rank*")):
        logs[int(sub.name[4:])] = read_events(sub)
    return logs


def _active_pid(run_dir: Path, rank: int) -> int:
    return [e["pid"] for e in _agent_events(run_dir).get(rank, []) if e["event"] == "process_started"
            and e["role"] == "active" and e["rank"] == rank][-1]


def _kill_active_mid_run(run_dir: Path, rank: int) -> int:
    """Once the shadows are ready and the run is past step 8: SIGKILL rank ``rank``'s active trainer."""
    metrics = run_dir / "csv" / "version_0" / "metrics.csv"

    def ready() -> bool:
        events = [e for log in _agent_events(run_dir).values() for e in log]
        return (any(e["event"] == "shadow_level" and e.get("reason") == "ready" for e in events)
                and metrics.exists() and sum(1 for _ in open(metrics)) > 8)

    wait_for(ready, 200, "shadows ready and step 8")
    victim = _active_pid(run_dir, rank)
    os.kill(victim, signal.SIGKILL)
    return victim


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (torchrun and the agents pass it on to what they started), then wait."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _check_recovered(run_dir: Path, victim: int, victim_rank: int, reference: Run) -> Run:
    logs = _agent_events(run_dir)
    assert sorted(logs) == [0, 1]
    run = Run(0, "", run_dir, logs[0])
    assert_nothing_left(Run(0, "", run_dir, [e for log in logs.values() for e in log]))
    (failure,) = [e for e in logs[victim_rank] if e["event"] == "failure_detected"]
    assert failure["pid"] == victim and failure["signal"] == signal.SIGKILL
    for rank, log in logs.items():  # every agent recovered in lockstep, by promoting its shadow
        (done,) = [e for e in log if e["event"] == "recovery_finished"]
        assert done["promoted"] == "shadow", (rank, done)
        # the agent of local rank 0 repaired both ranks' stores (tier 2 spans them), the other none
        assert [r.split(":")[0] for r in done["repair"]] == (["rank 0", "rank 1"] if rank == 0 else []), done
    assert len({e["job_id"] for log in logs.values() for e in log if e["event"] == "job_started"}) == 1
    for rank in range(2):
        assert same_state(run.final(rank), reference.final(rank)) == [], f"rank {rank}"
    assert run.loss_series() == reference.loss_series()
    assert len(run.recovery_rows()) == 1  # rank 0's agent's log only: the recovery once
    return run


def test_torchrun_rank_is_supervised_and_recovers_in_place(reference: Run, tmp_path) -> None:
    """torchrun --standalone --nproc-per-node 2: rank 1's active trainer SIGKILLed from outside;
    torchrun exits 0, and the run equals the fault-free one bit for bit."""
    run_dir = tmp_path / "run"
    env = dict(QUIET, LETO_RUN_DIR=str(run_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *script_args(STEPS, "--sleep", "0.15")]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        victim = _kill_active_mid_run(run_dir, 1)
        proc.wait(timeout=240)
    finally:
        _stop([proc])
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert proc.returncode == 0, output[-5000:]
    assert "LetoStrategy under torchrun: each rank becomes its own supervisor" in output
    run = _check_recovered(run_dir, victim, 1, reference)
    (started,) = run.of("job_started")
    assert started["world_size"] == 2 and started["node_rank"] == 0


def _slurm_job_id() -> str:
    """A job id whose derived port (15000 + its last four digits, Lightning's rule) is free now."""
    for port in range(15000 + os.getpid() % 9000, 25000):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return f"7{port - 15000:04d}"
    raise AssertionError("no free port in 15000-24999")


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_srun_ranks_are_supervised_and_recover_in_place(reference: Run, tmp_path) -> None:
    """Two processes with srun's variables (what srun gives each task on one node): each becomes
    its rank's agent, rank 0's hosting the store at Lightning's SLURM address and port; rank 0's
    active trainer SIGKILLed from outside; bit-identical to the fault-free run."""
    job = _slurm_job_id()
    base = {k: v for k, v in QUIET.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "LETO_RUN"))
            and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")}
    base.update(SLURM_JOB_ID=job, SLURM_JOB_NAME="leto-test", SLURM_NODELIST="localhost", SLURM_NNODES="1",
                SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NODEID="0")
    procs, logs = [], []
    try:
        for rank in range(2):
            logs.append(open(tmp_path / f"task{rank}.log", "w"))
            env = dict(base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
            procs.append(subprocess.Popen([sys.executable, *script_args(STEPS, "--sleep", "0.15")], env=env,
                                          cwd=tmp_path, stdout=logs[-1], stderr=subprocess.STDOUT))
        run_dir = tmp_path / "leto-runs" / f"slurm-{job}"
        victim = _kill_active_mid_run(run_dir, 0)
        for p in procs:
            p.wait(timeout=240)
    finally:
        _stop(procs)
        for f in logs:
            f.close()
    outputs = [(tmp_path / f"task{r}.log").read_text() for r in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "LetoStrategy under srun: each rank becomes its own supervisor" in outputs[0]
    run = _check_recovered(run_dir, victim, 0, reference)
    (started,) = run.of("job_started")
    assert started["port"] == 15000 + int(job[-4:])


# -- without launching anything ----------------------------------------------------------------
_TORCHRUN = dict(TORCHELASTIC_RUN_ID="abc", RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 GROUP_RANK="0", MASTER_ADDR="host0", MASTER_PORT="29400", TORCHELASTIC_USE_AGENT_STORE="True",
                 TORCHELASTIC_RESTART_COUNT="0")


def test_torchrun_rank_layout_and_store() -> None:
    from leto_lightning.integrations.lightning.per_rank import from_torchrun

    shared = from_torchrun(_TORCHRUN)
    assert (shared.rank, shared.world_size, shared.local_rank, shared.local_world_size, shared.node_rank) == (
        1, 2, 1, 2, 0)
    assert shared.external_store and shared.store_prefix == "leto/abc/0" and shared.master_port == 29400
    assert shared.run_dir == os.path.join("leto-runs", "torchrun-abc-29400")
    own = from_torchrun(dict(_TORCHRUN, TORCHELASTIC_USE_AGENT_STORE="False", TORCHELASTIC_RESTART_COUNT="2",
                             LETO_RUN_DIR="/x"))
    assert not own.external_store and own.store_prefix == "" and own.run_dir == "/x"  # rank 0's agent hosts


def test_launch_spec_checks_the_trainer_layout() -> None:
    from leto_lightning.runtime.agent import LaunchSpec

    spec = LaunchSpec("s.py", [], nnodes=4, node_rank=3, master_port=1, trainer_layout=(1, 2, 1), run_dir="r")
    assert spec.events_dir == os.path.join("r", "agents", "rank3")
    with pytest.raises(ValueError, match="--nproc-per-node must be 1"):
        LaunchSpec("s.py", [], nproc_per_node=2, nnodes=2, trainer_layout=(0, 2, 0))
    with pytest.raises(ValueError, match="node by node"):
        LaunchSpec("s.py", [], nnodes=4, node_rank=1, trainer_layout=(0, 2, 1))
    with pytest.raises(ValueError, match="local rank < local world size"):
        LaunchSpec("s.py", [], nnodes=2, node_rank=1, trainer_layout=(2, 2, 0))
    with pytest.raises(ValueError, match="external store needs"):
        LaunchSpec("s.py", [], external_store=True)
