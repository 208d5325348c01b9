"""Replacement shadows and cold starts, with and without the warm template, side by side.

For each launcher -- ``leto launch`` of a plain PyTorch script and of a Lightning script, and
``accelerate launch`` of the Accelerate example -- two jobs run with the same SIGKILL (rank 1,
inside an update, once a shadow set is ready): one with the warm template (the default), one
with ``--no-warm-template`` (``LETO_WARM_TEMPLATE=0`` under ``accelerate launch``; ``LETO_SHADOWS=0`` for
``--no-shadows``). Printed per
job:

- ``next ready``: the promotion of the shadow set -> the next shadow set ready (seconds), the
  window in which a second failure would be a cold start;
- ``cold start``: the same kill with ``--no-shadows`` -> the first completed iteration after it
  (``recovery_finished.total_s``: detect, stop, new trainers' start and set-up, the redone
  iteration);
- ``equal``: the final weights and optimizer state of every rank ``torch.equal`` across the
  two jobs.

    python benchmarks/shadow_readiness.py [--cases plain,lightning,accelerate] [--repeat 1]

Times are wall-clock on this machine, under whatever else runs: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import leto_lightning.examples as examples

EXAMPLES = Path(examples.__file__).parent
ROOT = Path(__file__).resolve().parent.parent
FAULT = {"id": 0, "rank": 1, "iteration": 6, "point": "chunk.math_done", "wait_shadows": True}
CASES = {
    "plain": (EXAMPLES / "plain_ddp.py", ["--iterations", "30", "--sleep", "0.3"]),
    "lightning": (EXAMPLES / "lightning_tiny.py", ["--max-steps", "30", "--sleep", "0.3", "--checkpoint-every", "0"]),
    "accelerate": (EXAMPLES / "accelerate_train.py", ["--epochs", "4", "--sleep", "0.25"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(run_dir: Path) -> list[dict]:
    logs = [run_dir / "events.jsonl", *sorted((run_dir / "agents").glob("rank*/events.jsonl"))]
    return [json.loads(line) for log in logs if log.exists() for line in log.read_text().splitlines() if line]


def _job(case: str, run_dir: Path, template: bool, shadows: bool) -> Path:
    """Run one job; return the directory its final files are in."""
    script, args = CASES[case]
    fault = dict(FAULT, wait_shadows=shadows)  # without shadows there is nothing to wait for
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    if case == "accelerate":
        run_dir.mkdir(parents=True)
        env.update(LETO_FAULTS=json.dumps([fault]), LETO_RUN_DIR=str(run_dir))
        if not template:
            env["LETO_WARM_TEMPLATE"] = "0"
        if not shadows:
            env["LETO_SHADOWS"] = "0"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/leto.yaml"), "--main_process_port", str(_free_port()), str(script),
               *args, "--out", str(run_dir)]
    else:
        cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
               "--faults", json.dumps([fault]), *([] if template else ["--no-warm-template"]),
               *([] if shadows else ["--no-shadows"]), str(script), *args]
    done = subprocess.run(cmd, env=env, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{case} job failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return run_dir


def _next_ready_s(run_dir: Path) -> float:
    """Promotion of a shadow set -> the next set ready (node 0's agent)."""
    log = [e for e in _events(run_dir) if e.get("event") in ("shadows_promoted", "shadow_level")]
    promoted = next(e for e in log if e["event"] == "shadows_promoted")
    ready = next(e for e in log if e["event"] == "shadow_level" and e.get("reason") == "ready"
                 and e["time"] > promoted["time"])
    return ready["time"] - promoted["time"]


def _cold_start_s(run_dir: Path) -> float:
    (done,) = [e for e in _events(run_dir) if e.get("event") == "recovery_finished"][:1]
    assert done["promoted"] == "cold", done
    return float(done["total_s"])


def _same_finals(a: Path, b: Path) -> bool:
    for f in sorted(a.glob("final_rank*.pt")):
        x, y = torch.load(f, weights_only=False), torch.load(b / f.name, weights_only=False)
        if not _equal(x, y):
            return False
    return any(a.glob("final_rank*.pt"))


def _equal(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y


def measure(case: str, base: Path, repeat: int) -> dict:
    row: dict = {"case": case}
    for template in (False, True):
        name = "template" if template else "no template"
        ready = [_next_ready_s(_job(case, base / f"{case}-{name}-ready-{i}", template, True)) for i in range(repeat)]
        cold = [_cold_start_s(_job(case, base / f"{case}-{name}-cold-{i}", template, False)) for i in range(repeat)]
        row[name] = {"next_ready_s": statistics.median(ready), "cold_start_s": statistics.median(cold)}
    row["equal"] = all(_same_finals(base / f"{case}-template-{k}-0", base / f"{case}-no template-{k}-0")
                       for k in ("ready", "cold"))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="plain,lightning,accelerate", help=f"comma-separated of {', '.join(CASES)}")
    p.add_argument("--repeat", type=int, default=1, help="jobs per cell (the median is shown)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="leto-readiness-") as tmp:
        print(f"{'case':<11} {'next ready: before':>19} {'after':>7} {'cold start: before':>19} {'after':>7}  equal")
        for case in args.cases.split(","):
            row = measure(case, Path(tmp), args.repeat)
            rows.append(row)
            before, after = row["no template"], row["template"]
            print(f"{case:<11} {before['next_ready_s']:>18.2f}s {after['next_ready_s']:>6.2f}s "
                  f"{before['cold_start_s']:>18.2f}s {after['cold_start_s']:>6.2f}s  {row['equal']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
