"""Real processes, real signals, gloo on CPU, 2 ranks: the runtime's must-shows (issue 3)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from leto_lightning.faults.plan import planned_faults

from .harness import finish, run, same_state, start, stop, wait_for

pytestmark = pytest.mark.usefixtures("warm_template")  # later trainers forked from the warm template

ITERATIONS = 50


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run every faulty run must match bit for bit."""
    result = run(tmp_path_factory.mktemp("reference"), ITERATIONS)
    assert result.returncode == 0, result.output[-3000:]
    assert not result.of("failure_detected")
    return result


def _hof_faults(seed: int) -> list[dict]:
    """Six HOFs at seeded random occurrences of the required kinds of point."""
    plan = [  # (ranks, point, iteration window)
        ([0], "compute.begin", (2, 4)),
        ([1], "chunk.math_done", (10, 12)),  # mid-update
        ([0], "chunk.tier1_partial", (18, 20)),  # mid-parity-update
        ([1], "record.half_written", (26, 28)),  # during a progress-record write
        ([0, 1], "chunk.tier2_partial", (34, 36)),  # both ranks at once
        ([1], "chunk.committed", (42, 44)),
    ]  # each strikes once a fresh shadow set is ready ("wait_shadows"): a long job's steady state
    most = {"compute.begin": 1, "record.half_written": 2}  # how often a point occurs per iteration (else 4)
    return planned_faults([(ranks, point, window, most.get(point, 4)) for ranks, point, window in plan], seed)


def test_hofs_at_random_points_end_bit_identical(tmp_path, reference):
    faults = _hof_faults(seed=int(os.environ.get("LETO_SEED", "0")))
    result = run(tmp_path, ITERATIONS, faults=faults)
    assert result.returncode == 0, result.output[-3000:]
    finished = [e for e in result.of("recovery_finished") if not e.get("interrupted")]
    assert len(finished) >= 5, [e["event"] for e in result.events]
    assert all(e["promoted"] == "shadow" for e in finished), [e["promoted"] for e in finished]
    assert all(e["first_iteration_s"] >= 0 for e in finished)
    assert all(e["breakdown"]["recompute"] >= 0 for e in finished)
    for e in finished:  # consecutive parts of one time line: they add up to the total
        assert abs(sum(e["breakdown"].values()) - e["total_s"]) < 1e-3, e
    for e in result.of("failure_detected"):
        assert e["signal"] == signal.SIGKILL
    for e in finished:  # at most one iteration recomputed per HOF
        assert e["resume_iteration"] >= e["failed_iteration"]
    assert not result.of("fallback_checkpoint"), "a HOF must never take the checkpoint path"
    for r in range(2):
        assert same_state(result.final(r), reference.final(r)) == []
        assert result.losses(r) == reference.losses(r)


def test_hang_detected_and_waiting_shadow_replaced(tmp_path, reference):
    proc = start(tmp_path, ITERATIONS, extra=["--heartbeat-timeout", "6"], script_args=["--sleep", "0.15"])
    try:
        events = lambda: list(_events(tmp_path))
        wait_for(lambda: any(e["event"] == "process_started" and e["role"] == "shadow" for e in events())
                 and os.path.exists(tmp_path / "loss_rank1.jsonl")
                 and sum(1 for _ in open(tmp_path / "loss_rank1.jsonl")) >= 8, 120, "training to get going")
        shadow = next(e["pid"] for e in events() if e["event"] == "process_started" and e["role"] == "shadow")
        os.kill(shadow, signal.SIGKILL)  # a waiting shadow dies: it must be replaced
        wait_for(lambda: any(e["event"] == "shadow_failed" for e in events()), 30, "shadow replacement")
        wait_for(lambda: any(e["event"] == "shadow_level" and e["shadow_set"] == "0-1" for e in events()), 30,
                 "the new shadow set")
        active = [e["pid"] for e in events() if e["event"] == "process_started" and e["role"] == "active"][-1]
        stopped_at = time.time()
        os.kill(active, signal.SIGSTOP)  # a hang
    except BaseException:
        stop(proc)
        raise
    result = finish(proc, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    hang = [e for e in result.of("failure_detected") if e["hang"]]
    assert len(hang) == 1 and hang[0]["pid"] == active
    assert hang[0]["time"] - stopped_at < 6 + 10  # within the timeout (+ slack for a loaded machine)
    assert len(result.of("recovery_finished")) == 1
    for r in range(2):
        assert same_state(result.final(r), reference.final(r)) == []


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_shadow_dying_during_promotion_starts_next_generation(tmp_path, reference):
    faults = [{"id": 0, "rank": 0, "iteration": 6, "point": "chunk.math_done", "occurrence": 2},
              {"id": 1, "rank": 1, "point": "promotion.resume"}]  # the promoted shadow of rank 1 dies
    result = run(tmp_path, ITERATIONS, faults=faults)
    assert result.returncode == 0, result.output[-3000:]
    assert len(result.of("recovery_failed")) == 1
    gens = [e["generation"] for e in result.of("recovery_started")]
    assert gens == [1, 2]
    done = result.of("recovery_finished")[-1]
    assert done["generation"] == 2
    # detect counts from the last poll that saw nothing wrong: not from before the first attempt
    first_started = result.of("recovery_started")[0]["time"]
    assert done["breakdown"]["detect"] < result.of("failure_detected")[-1]["time"] - first_started
    for r in range(2):
        assert same_state(result.final(r), reference.final(r)) == []


def test_non_hof_failure_takes_the_checkpoint_path(tmp_path, reference):
    """Rank 1 is SIGKILLed (a HOF) while it writes its iteration-20 checkpoint, after rank 0
    wrote its own; a later failure declared not a HOF restarts both from checkpoints. Iteration
    20 was never committed job-wide (rank 1 never finished it): both ranks resume from 10, and
    the job ends bit-identical to the fault-free run (before the job-wide commit, rank 0 resumed
    at 20 and rank 1 at 10, and their all-reduces paired different iterations)."""
    faults = [{"id": 0, "rank": 1, "iteration": 19, "point": "checkpoint.saving", "wait_shadows": True},
              {"id": 1, "rank": 1, "iteration": 23, "point": "compute.begin", "action": "exit", "code": 43}]
    result = run(tmp_path, ITERATIONS, faults=faults, extra=["--non-hof-exit-code", "43"])
    assert result.returncode == 0, result.output[-3000:]
    verdicts = result.of("classification")
    assert [v["hof"] for v in verdicts] == [True, False] and "43" in verdicts[1]["reason"]
    (fallback,) = result.of("fallback_checkpoint")
    assert "non-HOF" in fallback["reason"]
    assert "restarting from the last checkpoint" in result.output
    (restarted,) = result.of("checkpoint_restart_finished")
    assert restarted["first_iteration"] == 10 and restarted["recompute_iterations"] == 13, restarted
    checkpoints = tmp_path / "checkpoints"  # the newest committed one stays, older ones are gone
    assert sorted(p.name for p in checkpoints.iterdir()) == ["it000000050"]
    assert sorted(p.name for p in (checkpoints / "it000000050").iterdir()) == ["COMMITTED", "rank0.pt", "rank1.pt"]
    for r in range(2):
        assert same_state(result.final(r), reference.final(r)) == []
        assert result.losses(r) == reference.losses(r)


def _events(run_dir):
    from leto_lightning.runtime.events import iter_events

    return iter_events(run_dir)


@pytest.mark.slow  # LETO_LONG=1; the same mechanism runs in CI elsewhere
def test_level1_shadow_builds_after_promotion(tmp_path, reference):
    """L1: the shadow holds only the interpreter and imports; it builds everything once promoted."""
    faults = [{"id": 0, "rank": 1, "iteration": 9, "point": "chunk.math_done", "occurrence": 1, "wait_shadows": True}]
    result = run(tmp_path, ITERATIONS, faults=faults, extra=["--shadow-level", "1"])
    assert result.returncode == 0, result.output[-3000:]
    (done,) = result.of("recovery_finished")
    assert done["promoted"] == "shadow" and done["breakdown"]["init"] > 0
    assert {e["level"] for e in result.of("shadow_level")} == {1}
    for r in range(2):
        assert same_state(result.final(r), reference.final(r)) == []


def test_failure_budget_stops_cleanly(tmp_path):
    faults = [{"id": 0, "rank": 0, "iteration": 12, "point": "chunk.math_done", "wait_shadows": True},
              {"id": 1, "rank": 1, "iteration": 15, "point": "compute.begin", "wait_shadows": True}]
    result = run(tmp_path, ITERATIONS, faults=faults, extra=["--max-failures", "1"])
    assert result.returncode == 3, result.output[-3000:]
    (stopped,) = result.of("job_stopped")
    assert "exceed the budget of 1" in stopped["reason"] and "checkpoint" in stopped["reason"]
    assert "job stopped" in result.output
    # the last committed checkpoint is intact: every rank's file and the job-wide mark
    committed = sorted((tmp_path / "checkpoints").glob("it*/COMMITTED"))
    assert committed and (committed[-1].parent / "rank0.pt").exists(), list((tmp_path / "checkpoints").rglob("*"))


def test_sigterm_stops_everything_and_frees_memory(tmp_path):
    proc = start(tmp_path, ITERATIONS, script_args=["--sleep", "0.2"])
    try:
        wait_for(lambda: os.path.exists(tmp_path / "loss_rank0.jsonl"), 120, "training to start")
    except BaseException:
        stop(proc)
        raise
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, tmp_path)  # asserts: no process left, port closed (and the suite: no segment left)
    assert result.returncode == 128 + signal.SIGTERM
    assert result.of("job_interrupted")


def test_trainers_die_with_a_killed_agent(tmp_path):
    """SIGKILL of `leto launch` itself: its trainers and shadows go with it (PR_SET_PDEATHSIG);
    the retained memory it could not free is freed by `leto cleanup RUN_DIR`."""
    from leto_lightning import cli
    from leto_lightning.retained.shm import list_segments, unlink_segments
    from leto_lightning.runtime.procs_state import is_alive

    proc = start(tmp_path, ITERATIONS, script_args=["--sleep", "0.2"])
    try:
        wait_for(lambda: os.path.exists(tmp_path / "loss_rank0.jsonl"), 120, "training to start")
        proc.kill()
        proc.communicate()
        events = list(_events(tmp_path))
        pids = [e["pid"] for e in events if e["event"] == "process_started"]
        wait_for(lambda: not any(is_alive(p) for p in pids), 10, "the trainers to die with the agent")
        (job_id,) = [e["job_id"] for e in events if e["event"] == "job_started"]
        left = list_segments(f"leto-{job_id}-")
        assert left, "the killed agent could not free its memory"
        assert cli.main(["cleanup", "--list"]) == 0
        assert cli.main(["cleanup", str(tmp_path)]) == 0  # `leto cleanup RUN_DIR`
        assert list_segments(f"leto-{job_id}-") == []
    finally:
        stop(proc)
        for e in _events(tmp_path):
            if e["event"] == "job_started":
                unlink_segments(e["job_id"])
