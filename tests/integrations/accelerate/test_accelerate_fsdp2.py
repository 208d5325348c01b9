"""``LetoAccelerator`` with Accelerate's FSDP2 plugin (2 gloo ranks on CPU, ``acc_fsdp2_train.py``).

- Fault-free, in forked ranks: local shards, AdamW state, LR, losses and grad norms bit-identical
  to plain ``accelerate.Accelerator`` with the same plugin (uneven shards, a shuffled loader,
  accumulation 2, ``clip_grad_norm_`` on DTensor gradients, a prepared schedule), the shards
  and their gradients views into the retained store.
- ``mixed_precision='bf16'``: bit-identical to plain, the retained master shards fp32.
- ``save_state`` mid-epoch, the job stopped, a new job ``load_state``s it: bit-identical.
- ``load_state`` of an earlier checkpoint mid-run: bit-identical to plain Accelerate doing the same.
- FSDP1 and FSDP2 options that leave retained memory refused, naming the fix.
- (slow) Under ``accelerate launch --config_file configs/accelerate/leto-fsdp2.yaml`` and ``leto
  launch``: five SIGKILLs in one run (inside an update, after a step, mid accumulation,
  both ranks at once from outside, one more from outside), exit 0, bit-identical to the plain
  run; under ``leto launch``, the agent's checkpoint fallback after damage beyond parity.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import acc_fsdp2_train
import pytest
import torch

from leto_lightning.env import FAULTS, JOB_ID, RESUME, ROLE, RUN_DIR
from leto_lightning.errors import ConfigurationError
from leto_lightning.runtime.events import read_events
from leto_lightning.testing.launched import LaunchedRun, free_port, leftovers, stop, wait_for
from tests.updater.fsdp2_job import fork_ranks

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(acc_fsdp2_train.__file__)
CONFIG = ROOT / "configs" / "accelerate" / "leto-fsdp2.yaml"
WORLD = 2
_CLEAR = (ROLE, RUN_DIR, FAULTS, RESUME, JOB_ID, "TORCHELASTIC_RUN_ID",
          "ACCELERATE_USE_FSDP", "FSDP_VERSION")


def _rank_main(rank: int, port: int, argv: list[str]) -> None:
    from accelerate.state import AcceleratorState, GradientState

    for key in _CLEAR:
        os.environ.pop(key, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0")
    AcceleratorState._reset_state(reset_partial_state=True)  # a state the pytest process may hold
    GradientState._reset_state()
    acc_fsdp2_train.main(argv)


def run_forked(out: Path, *args: str, timeout: float = 120.0) -> None:
    """The script's ``main`` in one forked child per rank; every child reaped by pid, exit 0."""
    port = free_port()
    codes = fork_ranks(WORLD, lambda rank: _rank_main(rank, port, ["--out", str(out), *args]), timeout)
    assert codes == dict.fromkeys(range(WORLD), 0), f"rank exit codes {codes}"


def rows(out: Path, rank: int) -> dict[int, dict]:
    """Logged rows by optimizer step (a redone step logs again: the last row counts)."""
    found: dict[int, dict] = {}
    for line in (out / f"losses_rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        found[row["step"]] = row
    return found


def differences(out: Path, reference: Path) -> list[str]:
    diffs = []
    for rank in range(WORLD):
        mine = torch.load(out / f"final_rank{rank}.pt", weights_only=False)
        ref = torch.load(reference / f"final_rank{rank}.pt", weights_only=False)
        diffs += [f"rank {rank} param {n}" for n, p in ref["params"].items() if not torch.equal(mine["params"][n], p)]
        diffs += [f"rank {rank} state {n}.{k}" for n, st in ref["state"].items() for k, v in st.items()
                  if not torch.equal(torch.as_tensor(mine["state"][n][k]), torch.as_tensor(v))]
        if mine["lr"] != ref["lr"]:
            diffs.append(f"rank {rank} lr {mine['lr']} != {ref['lr']}")
        if rows(out, rank) != rows(reference, rank):
            diffs.append(f"rank {rank} losses/norms")
        if not (mine.get("in_store") and mine.get("padding_zero")):
            diffs.append(f"rank {rank}: not retained views ({mine.get('in_store')}) or padding not zero")
    return diffs


@pytest.fixture(scope="module")
def plain_accelerate_fsdp2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain_acc_fsdp2")
    run_forked(out, "--plain")
    return out


def test_fault_free_bit_identical_to_plain_accelerate_fsdp2(plain_accelerate_fsdp2: Path, tmp_path) -> None:
    run_forked(tmp_path, "--epochs", "3")
    assert differences(tmp_path, plain_accelerate_fsdp2) == []
    final = torch.load(tmp_path / "final_rank0.pt", weights_only=False)
    assert final["iteration"] == len(rows(tmp_path, 0)) == 12
    norms = [r["norm"] for r in rows(tmp_path, 0).values()]
    assert all(n > acc_fsdp2_train.MAX_NORM for n in norms)  # every step clipped


def test_bf16_mixed_precision_keeps_fp32_master_shards(tmp_path) -> None:
    """``mixed_precision='bf16'`` (FSDP2 computes in bf16): bit-identical to plain Accelerate with
    the same setting, the retained master shards and AdamW state fp32."""
    reference, out = tmp_path / "plain", tmp_path / "leto"
    run_forked(reference, "--plain", "--bf16", "--epochs", "1")
    run_forked(out, "--bf16", "--epochs", "1")
    assert differences(out, reference) == []
    final = torch.load(out / "final_rank0.pt", weights_only=False)
    assert {p.dtype for p in final["params"].values()} == {torch.float32}
    assert {v.dtype for st in final["state"].values() for v in st.values()} == {torch.float32}
    losses = [x for row in rows(out, 0).values() for x in row["losses"]]
    assert all(torch.tensor(x).to(torch.bfloat16).item() == x for x in losses)  # computed in bf16


def test_save_state_then_load_state_in_a_new_job(plain_accelerate_fsdp2: Path, tmp_path) -> None:
    """Accelerate's FSDP2 ``save_state`` (a distributed checkpoint read from the retained views)
    after step 6, mid-epoch; the job stops. A new job (new processes, new stores) ``load_state``s
    it into retained memory and finishes: bit-identical to the uninterrupted plain run."""
    run_forked(tmp_path, "--save-at", "6", "--stop-after", "6")
    assert not (tmp_path / "final_rank0.pt").exists() and len(rows(tmp_path, 0)) == 6
    saved = tmp_path / "checkpoints" / "step_6"
    assert {"leto_state_0.pt", "leto_state_1.pt"} <= {p.name for p in saved.iterdir()}
    run_forked(tmp_path, "--load-state", str(saved))
    assert differences(tmp_path, plain_accelerate_fsdp2) == []
    lines = (tmp_path / "losses_rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(12))  # the new job began at step 6
    assert torch.load(tmp_path / "final_rank1.pt", weights_only=False)["iteration"] == 12


def test_load_state_mid_run_as_plain_accelerate(tmp_path) -> None:
    """``save_state`` after step 3, ``load_state`` of it after step 6 (two steps are trained
    again from the checkpoint's state): shards, AdamW state, LR and losses bit-identical to plain
    Accelerate + FSDP2 doing the same; the job's iteration count goes on."""
    reference, out = tmp_path / "plain", tmp_path / "leto"
    run_forked(reference, "--plain", "--epochs", "2", "--save-at", "3", "--reload-at", "6")
    run_forked(out, "--epochs", "2", "--save-at", "3", "--reload-at", "6")
    assert differences(out, reference) == []
    assert torch.load(out / "final_rank0.pt", weights_only=False)["iteration"] == 8


def test_fsdp1_and_offload_refused(monkeypatch) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from leto_lightning.accelerate import LetoAccelerator

    with pytest.raises(ConfigurationError, match=r"fsdp_version=1\)\): FSDP1's flat parameters .*fsdp_version=2"):
        LetoAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    with pytest.raises(ConfigurationError, match=r"cpu_offload=.*leave cpu_offload off"):
        LetoAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=CPUOffloadPolicy()))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigurationError, match=r"^ACCELERATE_USE_FSDP=true with FSDP_VERSION=1 .*fsdp_version: 2"):
        LetoAccelerator()


# -- under accelerate launch, with failures ------------------------------------------------------
QUIET = {k: v for k, v in os.environ.items() if k not in _CLEAR and k not in (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} | {"PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}


def agent_events(run_dir: Path) -> dict[int, list[dict]]:
    """{rank: its per-rank agent's events} (rank r > 0 writes agents/rank<r>/)."""
    logs = {0: read_events(run_dir)} if (run_dir / "events.jsonl").exists() else {}
    for sub in sorted((run_dir / "agents").glob("rank*")):
        logs[int(sub.name[4:])] = read_events(sub)
    return logs


def all_events(run_dir: Path) -> list[dict]:
    return [e for log in agent_events(run_dir).values() for e in log]


def active_pid(run_dir: Path, rank: int) -> int:
    """The pid training as ``rank`` now: the last active started or shadow promoted."""
    events = all_events(run_dir)
    became = [(e["time"], e["pid"]) for e in events
              if e["event"] == "process_started" and e["role"] == "active" and e["rank"] == rank]
    for promo in (e for e in events if e["event"] == "shadows_promoted"):
        became += [(promo["time"], e["pid"]) for e in events if e["event"] == "process_started"
                   and e["role"] == "shadow" and e["shadow_set"] == promo["shadow_set"] and e["rank"] == rank]
    return max(became)[1]


def recoveries(run_dir: Path) -> int:
    return sum(e["event"] == "recovery_finished" for e in agent_events(run_dir).get(0, []))


def kill_from_outside(run_dir: Path, out: Path, ranks: tuple[int, ...], after_step: int, rng: random.Random,
                      ) -> list[int]:
    """SIGKILL the active trainers of ``ranks`` at a random moment after ``after_step`` was logged
    (ready shadows or not: without, the agents restart trainers on the retained state), and wait
    for the recovery; returns the pids killed."""
    done = recoveries(run_dir)
    wait_for(lambda: (out / "losses_rank0.jsonl").exists() and len(rows(out, 0)) > after_step, 200,
             f"step {after_step}")
    time.sleep(rng.uniform(0.0, 0.6))  # compute, accumulation or update
    pids = [active_pid(run_dir, r) for r in ranks]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: recoveries(run_dir) > done, 200, "the recovery")
    return pids


def _fault(fid: str, rank: int, where: str, iteration: int, occurrence: int = 1) -> dict:
    return {"id": fid, "rank": rank, "point": where, "iteration": iteration, "occurrence": occurrence,
            "wait_shadows": True}


def _start(launcher: str, tmp_path: Path, out: Path, faults: list[dict]) -> tuple[subprocess.Popen, Path]:
    """The script under ``accelerate launch`` (per-rank agents) or ``leto launch``."""
    script = [str(SCRIPT), "--out", str(out), "--epochs", "4", "--sleep", "0.4"]
    env = dict(QUIET, **{FAULTS: json.dumps(faults)})
    if launcher == "accelerate":
        port = free_port()
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--main_process_port", str(port), *script]
    else:
        cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir",
               str(tmp_path / "run"), "--faults", json.dumps(faults), *script]  # the agent sets LETO_FAULTS
    with open(tmp_path / "launch.log", "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    if launcher != "accelerate":
        return proc, tmp_path / "run"
    try:
        wait_for(lambda: any((tmp_path / "leto-runs").glob(f"accelerate-*-{port}")), 120, "the run dir")
    except BaseException:
        stop(proc)
        raise
    (run_dir,) = (tmp_path / "leto-runs").glob(f"accelerate-*-{port}")
    return proc, run_dir


@pytest.fixture(scope="module")
def plain_four_epochs(tmp_path_factory) -> Path:
    """Plain Accelerate + FSDP2 for 4 epochs: the reference of the launched runs below."""
    out = tmp_path_factory.mktemp("plain_four_epochs")
    run_forked(out, "--plain", "--epochs", "4")
    return out


# torchrun is not a third case here: ``accelerate launch`` starts its ranks through torchrun's
# launcher (per-rank agents, as under torchrun), and torchrun's own environment is the Accelerate
# DDP case tests/accelerate/test_accelerate_launch.py::test_torchrun_ranks_become_agents_and_recover.
@pytest.mark.slow  # LETO_LONG=1 and CI's slow stage: 40-60 s each on 2 loaded cores (shadows re-import torch)
@pytest.mark.parametrize("launcher", ["accelerate", "leto"])
def test_fsdp2_five_kills_bit_identical(launcher: str, tmp_path, plain_four_epochs: Path) -> None:
    """``accelerate launch --config_file configs/accelerate/leto-fsdp2.yaml`` (per-rank agents),
    ``leto launch`` (one agent): SIGKILLs inside an update (rank 1, a chunk's math done), after a step (rank
    0), mid accumulation (rank 1), both ranks at once from outside, one rank from outside: exit
    0, every recovery in place, local shards, AdamW state, LR, losses and grad norms
    bit-identical to plain Accelerate + FSDP2."""
    reference = plain_four_epochs
    out, log = tmp_path / "out", tmp_path / "launch.log"
    faults = [_fault("update", 1, "chunk.math_done", 2), _fault("between", 0, "accelerate.after_step", 4),
              _fault("accumulation", 1, "compute.begin", 6, occurrence=2)]
    proc, run_dir = _start(launcher, tmp_path, out, faults)
    try:
        wait_for(lambda: recoveries(run_dir) >= 3, 300, "the three injected faults' recoveries")
        rng = random.Random(14)
        kills = [kill_from_outside(run_dir, out, (0, 1), 8, rng), kill_from_outside(run_dir, out, (1,), 11, rng)]
        proc.wait(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-5000:]
    assert differences(out, reference) == []
    failed = {e["pid"]: e for e in all_events(run_dir) if e["event"] == "failure_detected" and e["pid"]}
    assert all(e["signal"] == signal.SIGKILL for e in failed.values()), failed
    assert all(set(pids) & set(failed) for pids in kills), (kills, sorted(failed))
    for rank, events in agent_events(run_dir).items():
        finished = [e for e in events if e["event"] == "recovery_finished"]
        assert len(finished) == 5 and all(e["promoted"] in ("shadow", "cold") for e in finished), (rank, finished)
    left = leftovers(LaunchedRun(0, "", run_dir, all_events(run_dir)))
    assert not left, "; ".join(left)


@pytest.mark.slow  # LETO_LONG=1 and CI's slow stage: about 25 s on 2 loaded cores
def test_leto_launch_fsdp2_damage_beyond_parity_restarts_from_save_state(tmp_path, plain_four_epochs: Path) -> None:
    """Under ``leto launch``: ``save_state`` after step 4 (a distributed checkpoint of the shards),
    then both active trainers stopped, both ranks' data pages overwritten (beyond tier-1 and
    tier-2 parity: nothing else holds a shard) and both SIGKILLed. The agent reports the damage,
    restarts every trainer with ``LETO_RESUME=checkpoint``; ``leto_resume()`` loads step 4's
    checkpoint and the job ends bit-identical to the uninterrupted plain run."""
    reference = plain_four_epochs
    out, run_dir = tmp_path / "out", tmp_path / "run"
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           str(SCRIPT), "--out", str(out), "--epochs", "4", "--save-at", "4", "--sleep", "0.3"]
    log = tmp_path / "leto.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=QUIET, stdout=f, stderr=subprocess.STDOUT)
    try:
        records = [run_dir / "accelerate" / f"checkpoints_rank{r}.json" for r in range(2)]
        wait_for(lambda: all(p.exists() for p in records) and (out / "losses_rank0.jsonl").exists()
                 and len(rows(out, 0)) > 5, 300, "step 4's checkpoint recorded by both ranks, and step 5")
        (job_id,) = {e["job_id"] for e in all_events(run_dir) if e["event"] == "job_started"}
        victims = [active_pid(run_dir, r) for r in range(2)]
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)  # nothing rewrites a page while it is overwritten
        segments = sorted(Path("/dev/shm").glob(f"*{job_id}-r*-data"))
        for path in segments:
            path.write_bytes(b"\xa5" * path.stat().st_size)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-5000:]
    assert len(segments) == 2
    events = all_events(run_dir)
    (fallback,) = [e for e in events if e["event"] == "fallback_checkpoint"]
    assert "damaged beyond what checksums, copies and parity can repair" in fallback["reason"], fallback
    restarted = [e for e in events if e["event"] == "process_started" and e["role"] == "active"][-2:]
    assert [e.get("resume") for e in restarted] == ["checkpoint"] * 2
    assert differences(out, reference) == []
    logged = [json.loads(line)["step"] for line in (out / "losses_rank0.jsonl").read_text().splitlines()]
    assert logged.count(1) == 1 and logged.count(4) == 2  # redone from step 4's checkpoint, not from the start
    left = leftovers(LaunchedRun(0, "", run_dir, events))
    assert not left, "; ".join(left)
