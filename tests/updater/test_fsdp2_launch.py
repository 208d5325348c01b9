"""FSDP2 under ``leto launch``: the real agent, L3 shadows, promotion and in-place recovery of a
plain-PyTorch FSDP2 script (``examples/plain_fsdp2.py``: uneven shards, accumulation, clipping,
an LR schedule, dropout), 2 gloo ranks per node, real processes and signals.

The reference is the same script without Leto, as torchrun runs it (forked ranks with
torchrun's environment): every launched run must end with bit-identical local shards (params and
AdamW state) and the same loss series.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from leto_lightning.examples import PLAIN_FSDP2
from leto_lightning.examples import plain_fsdp2 as script
from leto_lightning.retained.layout import GRAD
from leto_lightning.retained.store import RetainedStore
from leto_lightning.runtime.events import iter_events
from leto_lightning.runtime.trainers import stopped
from tests.runtime.harness import LaunchResult, finish, free_port, same_state, start, stop, wait_for

from .fsdp2_job import fork_ranks

ITERATIONS = 12
WORLD = 2
_PLAIN: dict[int, LaunchResult] = {}  # world size -> the plain run (once per session)


def plain_run(directory: Path, world: int = WORLD) -> LaunchResult:
    """The script under torchrun's environment (no Leto): ranks forked from this process."""
    if world in _PLAIN:
        return _PLAIN[world]
    out = directory / f"plain{world}"
    out.mkdir()
    port = free_port()

    def rank_main(rank: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        script.main(["--iterations", str(ITERATIONS), "--out", str(out)])

    codes = fork_ranks(world, rank_main, timeout=120)
    assert codes == dict.fromkeys(range(world), 0), f"plain FSDP2 ranks exited with {codes}"
    _PLAIN[world] = LaunchResult(0, "", out, [])
    return _PLAIN[world]


def assert_bit_identical(result: LaunchResult, plain: LaunchResult, world: int = WORLD) -> None:
    for rank in range(world):
        assert same_state(result.final(rank), plain.final(rank)) == [], f"rank {rank}: local shards differ"
        assert result.losses(rank) == plain.losses(rank), f"rank {rank}: loss series differs"
        assert len(plain.losses(rank)) == ITERATIONS


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The fault-free launched run: started before the faulty one and run beside it (that one
    mostly waits for its shadows to start); finished and checked by its own test."""
    run_dir = tmp_path_factory.mktemp("fault_free")
    proc = start(run_dir, ITERATIONS, script=PLAIN_FSDP2, extra=["--no-shadows"])
    yield proc, run_dir
    stop(proc)  # its test did not run or failed first


def _faults(seed: int) -> tuple[int, list[dict]]:
    """Seeded: both ranks frozen (SIGSTOP) as an iteration's compute begins (the test then wipes
    rank 1's shard and SIGKILLs both); later both ranks killed mid-update at once, each once a
    fresh shadow set is ready (a long job's steady state); then one rank killed mid-update while
    the next shadow set is still starting (an iteration after that recovery): a cold restart."""
    rng = random.Random(seed)
    frozen_at, both_at = rng.randint(1, 2), rng.randint(5, 6)
    steady = [  # frozen before the forward: neither waits in a collective meanwhile
        {"id": 0, "rank": 1, "iteration": frozen_at, "point": "compute.begin", "signal": int(signal.SIGSTOP)},
        {"id": 4, "rank": 0, "iteration": frozen_at, "point": "compute.begin", "signal": int(signal.SIGSTOP)},
        {"id": 1, "rank": 0, "iteration": both_at, "point": "chunk.math_done", "occurrence": rng.randint(1, 8)},
        {"id": 2, "rank": 1, "iteration": both_at, "point": "chunk.tier1_partial", "occurrence": rng.randint(1, 8)},
    ]
    cold = {"id": 3, "rank": rng.randint(0, 1), "iteration": both_at + 2, "point": "chunk.committed",
            "occurrence": rng.randint(1, 8)}
    return frozen_at, [dict(f, wait_shadows=True) for f in steady] + [cold]


def _trainers(run_dir: Path, generation: int) -> dict[int, int]:
    return {e["rank"]: e["pid"] for e in iter_events(run_dir)
            if e["event"] == "process_started" and e["role"] == "active" and e["generation"] == generation}


def _wipe_shard(job_id: str, rank: int) -> int:
    """Overwrite every data page of ``rank``'s store (its whole shard: params, grads, AdamW
    state). Returns how many of them tier 2 protects (all but the gradients)."""
    store = RetainedStore.attach(job_id, rank)
    try:
        store.pages.fill_(0x5A)
        return sum(kind != GRAD for kind in store.layout.page_kind)
    finally:
        store.close()


def _destroy_frozen_ranks(run_dir: Path) -> int:
    """Once both trainers froze: rank 1's retained shard overwritten, then both SIGKILLed."""
    def frozen() -> bool:
        pids = _trainers(run_dir, 0)
        return len(pids) == WORLD and all(stopped(pid) for pid in pids.values())

    wait_for(frozen, 300, "both trainers to freeze")
    (job_id,) = [e["job_id"] for e in iter_events(run_dir) if e["event"] == "job_started"]
    protected = _wipe_shard(job_id, 1)
    for rank in (1, 0):
        try:
            os.kill(_trainers(run_dir, 0)[rank], signal.SIGKILL)
        except ProcessLookupError:  # the agent, seeing rank 1 dead, already killed rank 0
            pass
    return protected


def test_hofs_and_a_destroyed_shard_recover_in_place_bit_identical(tmp_path, tmp_path_factory, fault_free):
    """5 SIGKILLs in one run: both trainers killed in compute with rank 1's whole retained shard
    overwritten (tier 2 is the only other copy under FSDP2: it rebuilds the shard), both ranks
    killed mid-update at once (shadows promoted), one more mid-update (new trainers attach: a
    cold restart); no checkpoint, bit-identical."""
    frozen_at, faults = _faults(seed=int(os.environ.get("LETO_SEED", "0")))
    proc = start(tmp_path, ITERATIONS, faults=faults, script=PLAIN_FSDP2)
    try:
        plain = plain_run(tmp_path_factory.getbasetemp())
        protected = _destroy_frozen_ranks(tmp_path)
    except BaseException:
        stop(proc)
        raise
    result = finish(proc, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert not result.of("fallback_checkpoint"), "a HOF must never take the checkpoint path"
    finished = [e for e in result.of("recovery_finished") if not e.get("interrupted")]
    assert [e["promoted"] for e in finished] == ["shadow", "shadow", "cold"], finished
    assert all(e["signal"] == signal.SIGKILL for e in result.of("failure_detected"))
    # the destroyed shard: every protected page rebuilt, by tier 2 (each tier-1 group lost all its pages)
    (rank1,) = [line for line in finished[0]["repair"] if line.startswith("rank 1:")]
    assert f"repaired {protected} page(s)" in rank1 and "(0 by tier 2)" not in rank1, rank1
    assert finished[0]["resume_iteration"] == frozen_at, finished[0]
    assert_bit_identical(result, plain)


def test_fault_free_under_leto_launch_bit_identical_to_plain_fsdp2(tmp_path_factory, fault_free):
    proc, run_dir = fault_free
    plain = plain_run(tmp_path_factory.getbasetemp())
    result = finish(proc, run_dir)
    assert result.returncode == 0, result.output[-3000:]
    assert not result.of("failure_detected")
    assert_bit_identical(result, plain)
    # uneven shards: the 97-row embedding splits 49 / 48
    assert [plain.final(r)["params"][0].shape[0] for r in range(WORLD)] == [49, 48]


@pytest.mark.slow  # LETO_LONG=1: the fallback mechanism runs in CI with DDP (tests/runtime)
def test_non_hof_failure_restarts_from_the_distributed_checkpoint_exactly(tmp_path, tmp_path_factory):
    """A failure declared not a HOF (exit code 43): the agent restarts every trainer from the
    script's newest distributed checkpoint (saved from the retained views every 4 iterations);
    the new job loads it into fresh retained stores and ends bit-identical."""
    faults = [{"id": 0, "rank": 1, "iteration": 9, "point": "compute.begin", "action": "exit", "code": 43}]
    proc = start(tmp_path, ITERATIONS, faults=faults, script=PLAIN_FSDP2, script_args=["--checkpoint-every", "4"],
                 extra=["--non-hof-exit-code", "43"])
    try:
        plain = plain_run(tmp_path_factory.getbasetemp())
    except BaseException:
        stop(proc)
        raise
    result = finish(proc, tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    (verdict,) = result.of("classification")
    assert verdict["hof"] is False and "43" in verdict["reason"]
    (fallback,) = result.of("fallback_checkpoint")
    assert "non-HOF" in fallback["reason"]
    restarted = [e for e in result.of("process_started") if e["role"] == "active" and e["resume"] == "checkpoint"]
    assert len(restarted) == WORLD, restarted
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["fsdp2-12", "fsdp2-4", "fsdp2-8"]
    assert_bit_identical(result, plain)


@pytest.mark.slow  # LETO_LONG=1: two agents and 4 ranks (~1 min on 2 loaded cores)
def test_two_node_agents_fsdp2_across_four_ranks(tmp_path, tmp_path_factory, monkeypatch):
    """Two node agents on loopback (2 + 2 ranks), FSDP2 sharded over all 4: rank 3 killed
    mid-update; node 0 learns of it from node 1's verdict; both recover in lockstep."""
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())  # every node's agent: the same secret
    port, world = free_port(), 2 * WORLD
    faults = [{"id": 0, "rank": 3, "iteration": 5, "point": "chunk.math_done", "occurrence": 2,
               "wait_shadows": True}]
    procs = []
    try:
        for node in (0, 1):
            extra = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port)]
            procs.append(start(tmp_path / f"node{node}", ITERATIONS, faults=faults, extra=extra, nproc=WORLD,
                               script=PLAIN_FSDP2))
        plain = plain_run(tmp_path_factory.getbasetemp(), world)
    except BaseException:
        for p in procs:
            stop(p)
        raise
    results = [finish(p, tmp_path / f"node{n}") for n, p in enumerate(procs)]
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
        (done,) = r.of("recovery_finished")
        assert done["promoted"] == "shadow" and done["resume_iteration"] == 6, done
    (verdict,) = results[0].of("classification")
    assert verdict["node"] == 1 and verdict["hof"]
    for node, r in enumerate(results):
        for local in range(WORLD):
            rank = node * WORLD + local
            assert same_state(r.final(rank), plain.final(rank)) == [], f"rank {rank}: local shards differ"
            assert r.losses(rank) == plain.losses(rank), f"rank {rank}: loss series differs"
