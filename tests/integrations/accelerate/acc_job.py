"""Run the Accelerate example (``examples/accelerate_train.py``) under ``accelerate launch``,
``leto launch`` or ``torchrun`` as real processes, kill its trainers from outside, and read what
it left: per-rank agents' events, final per-rank states, the tracker's loss rows."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from leto_lightning.runtime.events import read_events
from leto_lightning.testing import launched
from leto_lightning.testing.launched import LaunchedRun, free_port, stop, wait_for  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "accelerate" / "leto.yaml"
SCRIPT = ROOT / "src" / "leto_lightning" / "examples" / "accelerate_train.py"
QUIET = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true", PYTHONWARNINGS="ignore")
for _key in ("LETO_RUN_DIR", "LETO_FAULTS", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
    QUIET.pop(_key, None)
EPOCHS = 4  # 4 optimizer steps per epoch (64 sequences, 2 ranks x batch 2, accumulation 4): 16 steps


def accelerate_cmd(port: int, *script_args: str, config: Path = CONFIG) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--main_process_port", str(port), str(SCRIPT), "--epochs", str(EPOCHS), *script_args]


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, env=env or QUIET, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def agent_events(run_dir: Path) -> dict[int, list[dict]]:
    """{rank: its agent's events} (per-rank agents: rank r > 0 writes agents/rank<r>/)."""
    logs = {0: read_events(run_dir)} if (run_dir / "events.jsonl").exists() else {}
    for sub in sorted((run_dir / "agents").glob("rank*")):
        logs[int(sub.name[4:])] = read_events(sub)
    return logs


def all_events(run_dir: Path) -> list[dict]:
    return [e for log in agent_events(run_dir).values() for e in log]


def active_pid(run_dir: Path, rank: int) -> int:
    """The pid training as rank ``rank`` now: the last active started, or the rank's shadow of the
    last promoted set, whichever became active last."""
    events = all_events(run_dir)  # one agent for all ranks (leto launch) or one per rank
    became: list[tuple[float, int]] = [(e["time"], e["pid"]) for e in events if e["event"] == "process_started"
                                       and e["role"] == "active" and e["rank"] == rank]
    for promo in (e for e in events if e["event"] == "shadows_promoted"):
        became += [(promo["time"], e["pid"]) for e in events if e["event"] == "process_started"
                   and e["role"] == "shadow" and e["shadow_set"] == promo["shadow_set"] and e["rank"] == rank]
    return max(became)[1]


def loss_rows(out: Path) -> dict[int, dict]:
    """The tracker's rows by optimizer step (a recomputed step logs again: the last row counts)."""
    rows: dict[int, dict] = {}
    path = out / "losses.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "loss" in row:
                rows[row["step"]] = row
    return rows


def same_state(a: dict, b: dict, ema: bool = False) -> list[str]:
    """What is not bit-identical between two final states (weights, optimizer state, LR, EMA)."""
    diffs = [f"param {n}" for n in b["params"] if not torch.equal(a["params"][n], b["params"][n])]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    diffs += [f"optimizer state {i}.{k}" for i in sb for k, v in sb[i].items()
              if not torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(v))]
    if a["optimizer"]["param_groups"][0]["lr"] != b["optimizer"]["param_groups"][0]["lr"] or a["lr"] != b["lr"]:
        diffs.append(f"lr {a['lr']} != {b['lr']}")
    if ema:
        diffs += [f"ema {n}" for n in b["ema"] if not torch.equal(a["ema"][n], b["ema"][n])]
    return diffs


def finals(out: Path) -> list[dict]:
    return [torch.load(out / f"final_rank{r}.pt", weights_only=False) for r in range(2)]


def check_identical(out: Path, reference: Path, ema: bool = False) -> None:
    for rank, (mine, ref) in enumerate(zip(finals(out), finals(reference))):
        assert same_state(mine, ref, ema) == [], f"rank {rank}"
    assert loss_rows(out) == loss_rows(reference)
    assert len(loss_rows(out)) == 4 * EPOCHS


class Killer:
    """SIGKILLs active trainers from outside at random moments, one recovery at a time: each kill
    waits until the run made progress (and, with ``shadows=True``, a shadow set is ready; else the
    agents may start new trainers on the retained state instead of promoting shadows)."""

    def __init__(self, run_dir: Path, out: Path, seed: int) -> None:
        self.run_dir, self.out = run_dir, out
        self.rng = random.Random(seed)
        self.kills: list[list[int]] = []  # the pids of each kill (several: ranks at once)

    def ready(self) -> bool:
        """A shadow set became ready after the last recovery (any agent may announce it)."""
        events = all_events(self.run_dir)
        last = max((e["time"] for e in events if e["event"] == "recovery_finished"), default=0.0)
        return any(e["event"] == "shadow_level" and e.get("reason") == "ready" and e["time"] > last for e in events)

    def recoveries(self) -> int:
        return sum(1 for e in agent_events(self.run_dir).get(0, []) if e["event"] == "recovery_finished")

    def kill(self, ranks: tuple[int, ...], after_step: int, shadows: bool = False, timeout: float = 200) -> None:
        done = self.recoveries()
        wait_for(lambda: (self.ready() or not shadows) and len(loss_rows(self.out)) > after_step, timeout,
                 f"step {after_step}" + (" and shadows ready" if shadows else ""))
        time.sleep(self.rng.uniform(0.0, 0.6))  # a random moment: compute, accumulation or update
        pids = [active_pid(self.run_dir, r) for r in ranks]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        self.kills.append(pids)
        wait_for(lambda: self.recoveries() > done, timeout, "the recovery")


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        stop(proc)
    return log.read_text()


def assert_nothing_left(run_dir: Path) -> None:
    left = launched.leftovers(LaunchedRun(0, "", run_dir, all_events(run_dir)))
    assert not left, "; ".join(left)
