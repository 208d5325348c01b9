"""Hot spares: three node agents on loopback (2 training nodes + 1 spare, 2 ranks each).

A node is lost the way a machine is: its agent, trainers and shadows SIGKILLed at once (one
process group) and its retained memory unlinked from /dev/shm. The spare takes its slot with
the lost ranks' state from a data-parallel replica, and the job ends bit-identical to a run
without the failure. A second loss, with no spare left, stops the job and says why.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from leto_lightning.examples import PLAIN_DDP, PLAIN_FSDP2

from .harness import finish, free_port, launch_args, run, same_state, wait_for

ITERATIONS = 16
NPROC = 2


@dataclass(frozen=True)
class Job:
    """A user's script and its arguments; ``slow_down`` stretches an iteration so that a node
    can be killed in the middle of the run."""

    script: str
    args: tuple[str, ...] = ()
    slow_down: tuple[str, ...] = ()


DDP = Job(PLAIN_DDP, slow_down=("--sleep", "0.15"))
HSDP = Job(PLAIN_FSDP2, ("--hsdp", "2"))  # replica group 0 on node 0, replica group 1 on node 1
TIER3 = Job(PLAIN_FSDP2, ("--tier3",))  # no replica: each rank's state copied to the next node


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The fault-free runs on one node of 4 ranks: the same world, the same ring order."""
    done: dict[Job, object] = {}

    def reference(job: Job):
        if job not in done:
            result = run(tmp_path_factory.mktemp("reference"), ITERATIONS, nproc=2 * NPROC, script=job.script,
                         script_args=job.args)
            assert result.returncode == 0, result.output[-3000:]
            done[job] = result
        return done[job]

    return reference


def _start_nodes(tmp: Path, port: int, job: Job = DDP, faults=(), extra=()) -> list[subprocess.Popen]:
    """Node agents 0 and 1 and spare agent 2, each in a process group of its own (a machine)."""
    procs = []
    for node in range(3):
        options = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port), "--spares", "1",
                   "--node-timeout", "3", *extra]
        args = launch_args(tmp / f"node{node}", ITERATIONS, faults=faults, extra=options, nproc=NPROC,
                           script=job.script, script_args=[*job.args, *job.slow_down])
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True))
    return procs


def _iterations_logged(run_dir: Path, rank: int) -> int:
    path = run_dir / f"loss_rank{rank}.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _lose_node(proc: subprocess.Popen, run_dir: Path) -> None:
    """The machine is gone: every process of the node at once, and its retained memory."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    job = next(e["job_id"] for e in finish_events(run_dir) if e["event"] == "job_started")
    for segment in glob.glob(f"/dev/shm/leto-{job}*"):
        os.unlink(segment)


def finish_events(run_dir: Path) -> list[dict]:
    from leto_lightning.runtime.events import read_events

    return read_events(run_dir)


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def _lose_node_1(tmp: Path, job: Job, progress: Path, at: int) -> tuple:
    """Three agents of ``job``; node 1 lost once ``progress`` (a run dir) logged rank 2's
    iteration ``at``; node 0's and the spare's finished runs."""
    procs = _start_nodes(tmp, free_port(), job)
    try:
        wait_for(lambda: _iterations_logged(progress, 2) >= at, 240, f"node 1 at iteration {at}")
        _lose_node(procs[1], tmp / "node1")
        return finish(procs[0], tmp / "node0"), finish(procs[2], tmp / "node2")
    finally:
        _end(procs)


def _ends_as(reference, node0, spare) -> None:
    """Every rank ends as without the failure (the spare ran ranks 2 and 3 from the replacement on)."""
    for rank in range(2 * NPROC):
        holder = node0 if rank < NPROC else spare
        assert same_state(holder.final(rank), reference.final(rank)) == [], f"rank {rank}"


@pytest.mark.slow  # three launched agents (~45 s each case): CI's slow stage runs them
@pytest.mark.timeout(400)
@pytest.mark.parametrize("job", [DDP, HSDP], ids=["ddp", "hsdp"])
def test_spare_takes_over_a_lost_node_bit_identical(tmp_path, references, monkeypatch, job):
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())
    reference = references(job)
    node0, spare = _lose_node_1(tmp_path, job, tmp_path / "node1", at=5)
    assert node0.returncode == 0, node0.output[-4000:]
    assert spare.returncode == 0, spare.output[-4000:]
    (lost,) = node0.of("node_lost")
    assert (lost["node"], lost["agent"], lost["spare"]) == (1, 1, 2)
    (joined,) = spare.of("spare_joined")
    assert joined["node"] == 1 and joined["generation"] == lost["generation"]
    (sent,) = node0.of("state_transferred")
    (received,) = spare.of("state_transferred")
    assert sent["problem"] is None and received["problem"] is None
    assert received["bytes"] == sent["bytes"] > 0 and received["pages_verified"] > 0
    for result in (node0, spare):
        (done,) = result.of("recovery_finished")
        assert done["breakdown"]["transfer"] > 0 and done["resume_iteration"] >= 5
    _ends_as(reference, node0, spare)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_second_node_loss_with_no_spare_left_stops_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())
    procs = _start_nodes(tmp_path, free_port())
    try:
        wait_for(lambda: _iterations_logged(tmp_path / "node1", 2) >= 3, 240, "node 1 at iteration 3")
        _lose_node(procs[1], tmp_path / "node1")
        resumed = _iterations_logged(tmp_path / "node0", 0)
        wait_for(lambda: _iterations_logged(tmp_path / "node2", 2) >= 2 and
                 _iterations_logged(tmp_path / "node0", 0) > resumed + 1, 240, "the spare training as node 1")
        _lose_node(procs[2], tmp_path / "node2")  # the spare, now node 1, is lost too
        node0 = finish(procs[0], tmp_path / "node0")
    finally:
        _end(procs)
    assert node0.returncode == 3, node0.output[-4000:]
    first, second = node0.of("node_lost")
    assert (first["spare"], second["spare"], second["agent"]) == (2, None, 2)
    (stopped,) = node0.of("job_stopped")
    assert "node 1 lost" in stopped["reason"] and "no spare is left" in stopped["reason"]
    assert "resumes from its last checkpoint" in stopped["reason"]
    assert "no spare is left" in node0.output


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_unreplicated_shards_fall_back_to_the_checkpoint_with_the_reason(tmp_path, monkeypatch):
    """Plain FSDP2: the lost node's shards exist nowhere else. The spare still takes the slot,
    the source says why it cannot send, and the whole job (the spare included) restarts from
    the newest distributed checkpoint -- and still ends bit-identical."""
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())
    shared = tmp_path / "shared"  # checkpoints every node reads: a shared filesystem
    job = Job(PLAIN_FSDP2, ("--checkpoint-every", "4", "--out", str(shared)))
    reference = run(tmp_path / "reference", ITERATIONS, nproc=2 * NPROC, script=job.script,
                    script_args=["--checkpoint-every", "4", "--out", str(tmp_path / "reference-out")])
    assert reference.returncode == 0, reference.output[-3000:]
    node0, spare = _lose_node_1(tmp_path, job, shared, at=6)  # past the first checkpoint
    assert node0.returncode == 0 and spare.returncode == 0, node0.output[-3000:] + spare.output[-3000:]
    (fallback,) = node0.of("fallback_checkpoint")
    assert "holds a shard" in fallback["reason"] and "no other node has" in fallback["reason"]
    for rank in range(2 * NPROC):
        final = torch.load(shared / f"final_rank{rank}.pt", weights_only=True)
        expected = torch.load(tmp_path / "reference-out" / f"final_rank{rank}.pt", weights_only=True)
        assert same_state(final, expected) == [], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_unreplicated_shards_come_back_from_the_cross_node_tier(tmp_path, references, monkeypatch):
    """Plain FSDP2 with the cross-node tier (``--tier3``: each rank's prepared state kept on the
    next node): the spare rebuilds node 1's shards from node 0's copies, bit-identical."""
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())
    reference = references(Job(PLAIN_FSDP2))
    node0, spare = _lose_node_1(tmp_path, TIER3, tmp_path / "node1", at=5)
    assert node0.returncode == 0 and spare.returncode == 0, node0.output[-3000:] + spare.output[-3000:]
    assert not node0.of("fallback_checkpoint")
    (received,) = spare.of("state_transferred")
    assert received["problem"] is None and received["pages_verified"] > 0
    _ends_as(reference, node0, spare)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failure_that_is_not_a_hof_retires_its_node_and_a_spare_takes_over(tmp_path, references, monkeypatch):
    """Rank 2 exits with a code declared not a HOF (its device is not operable): node 1 leaves
    the job (trainers stopped, retained memory freed, exit 0), the spare takes its slot with the
    state of node 0's replicas; no checkpoint restart, bit-identical."""
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())
    reference = references(DDP)
    faults = [{"id": 0, "rank": 2, "iteration": 6, "point": "compute.begin", "action": "exit", "code": 42}]
    # the iteration's sleep comes before its all-reduce: node 1's agent sees rank 2's exit and
    # publishes its verdict before the other ranks' collectives fail (the first verdict decides)
    slow = Job(PLAIN_DDP, slow_down=("--sleep", "0.5"))
    procs = _start_nodes(tmp_path, free_port(), slow, faults=faults, extra=["--non-hof-exit-code", "42"])
    try:
        node0, node1, spare = (finish(p, tmp_path / f"node{n}") for n, p in enumerate(procs))
    finally:
        _end(procs)
    for run_ in (node0, node1, spare):
        assert run_.returncode == 0, run_.output[-3000:]
    (retired,) = node1.of("node_retired")
    assert "exit code 42 declared non-HOF" in retired["reason"]
    assert [(e["node"], e["spare"]) for e in node0.of("node_lost")] == [(1, 2)]
    assert not node0.of("fallback_checkpoint")
    _ends_as(reference, node0, spare)
