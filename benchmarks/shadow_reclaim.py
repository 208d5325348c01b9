"""Shadow memory reclaim: memory over time with and without reclaim, and recovery time per level.

    python benchmarks/shadow_reclaim.py [--out docs/figures/shadow_reclaim.png]

Part 1 runs examples/growing_memory.py under ``leto launch --memory-budget`` twice -- the policy
off, then on -- and samples, from outside, the private memory (RssAnon) of the active trainer
and of the shadow, and the job's retained /dev/shm segments, every 0.2 s. The plot marks the
budget and every shadow level change. Part 2, in the same run, injects one HOF (SIGKILL once a
shadow set is ready) into a job started at L3, L2, L1 and without shadows, and prints the
recovery time (failure -> first completed iteration after it) and its breakdown per level.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from leto_lightning.runtime.memory import SEGMENT_PREFIX, private_bytes, segment_bytes
from leto_lightning.testing.launched import finish, stop

EXAMPLE = str(Path(__file__).resolve().parent.parent / "src/leto_lightning/examples/growing_memory.py")
MIB = 1 << 20
BUDGET_MIB = 2500
GROWING = ["--iterations", "60", "--warm-mib", "768", "--grow-at", "10", "--grow-mib", "768", "--grow-step-mib", "32",
           "--sleep", "0.1"]


def launch(run_dir: Path, extra: list[str], script_args: list[str], faults=()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "1", "--run-dir", str(run_dir),
           "--faults", json.dumps(list(faults)), *extra, EXAMPLE, *script_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _events(run_dir: Path) -> list[dict]:
    try:
        with open(run_dir / "events.jsonl") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def sample_memory(proc: subprocess.Popen, run_dir: Path, every: float = 0.2) -> list[dict]:
    """Private memory per role and the job's retained segments, until the launcher exits."""
    samples, t0 = [], time.time()
    while proc.poll() is None:
        events = _events(run_dir)
        roles = {e["pid"]: e["role"] for e in events if e["event"] == "process_started"}
        job = next((e["job_id"] for e in events if e["event"] == "job_started"), None)
        row = {"t": time.time() - t0, "t_abs": time.time(), "active": 0, "shadow": 0,
               "retained": segment_bytes(SEGMENT_PREFIX + job + "-") if job else 0}
        for pid, role in roles.items():
            row[role] += private_bytes(pid)
        samples.append(row)
        time.sleep(every)
    return samples


def memory_run(run_dir: Path, reclaim: str) -> tuple[list[dict], list[dict], float]:
    proc = launch(run_dir, ["--memory-budget", f"{BUDGET_MIB}MiB", "--reclaim-low", "15%", "--reclaim-dwell", "1",
                            "--memory-reclaim", reclaim], GROWING)
    out: list = []
    sampler = threading.Thread(target=lambda: out.extend(sample_memory(proc, run_dir)))
    sampler.start()
    try:
        run = finish(proc, run_dir, timeout=400)
    finally:
        stop(proc)
        sampler.join()
    start = next(e["time"] for e in run.events if e["event"] == "job_started")
    return out, run.events, start


def recovery_run(run_dir: Path, level: int | None) -> dict:
    extra = ["--no-shadows"] if level is None else ["--shadow-level", str(level)]
    fault = {"id": 0, "rank": 0, "point": "compute.begin", "iteration": 12}
    if level is not None:
        fault["wait_shadows"] = True  # the steady state: a ready shadow set
    proc = launch(run_dir, extra, ["--iterations", "20", "--warm-mib", "256", "--grow-mib", "0", "--sleep", "0.1"],
                  [fault])
    try:
        run = finish(proc, run_dir, timeout=400)
    finally:
        stop(proc)
    done = [e for e in run.events if e["event"] == "recovery_finished"]
    if run.returncode != 0 or len(done) != 1:
        raise SystemExit(f"recovery at level {level}: exit {run.returncode}, {len(done)} recoveries\n"
                         f"{run.output[-2000:]}")
    return done[0]


def plot(runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, (name, (samples, events, start)) in zip(axes, runs.items()):
        t = [s["t"] for s in samples]
        total = [(s["active"] + s["shadow"] + s["retained"]) / MIB for s in samples]
        ax.plot(t, [s["active"] / MIB for s in samples], label="active trainer")
        ax.plot(t, [s["shadow"] / MIB for s in samples], label="shadow")
        ax.plot(t, total, label="job total", color="black", linewidth=1)
        ax.axhline(BUDGET_MIB, color="red", linestyle="--", linewidth=1, label="budget")
        origin = samples[0]["t_abs"] - samples[0]["t"] if samples else start  # the launcher's start
        for e in events:
            if e["event"] in ("shadow_level_changed", "memory_over_budget"):
                x = e["time"] - origin
                ax.axvline(x, color="grey", linestyle=":")
                label = f"L{e['old']}->L{e['new']}" if e["event"] == "shadow_level_changed" else "over budget"
                ax.text(x, BUDGET_MIB * 0.92, label, rotation=90, fontsize=7, ha="right")
        ax.set_title(f"reclaim {name}")
        ax.set_xlabel("seconds since launch")
    axes[0].set_ylabel("private memory (MiB)")
    axes[1].legend(fontsize=7, loc="center right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="docs/figures/shadow_reclaim.png")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="leto-bench-reclaim-") as tmp:
        runs = {name: memory_run(Path(tmp) / f"mem-{name}", name) for name in ("off", "on")}
        for name, (samples, events, _) in runs.items():
            peak = max((s["active"] + s["shadow"] + s["retained"]) / MIB for s in samples)
            changes = [f"L{e['old']}->L{e['new']}" for e in events if e["event"] == "shadow_level_changed"]
            over = sum(1 for e in events if e["event"] == "memory_over_budget")
            print(f"reclaim {name}: peak {peak:.0f} MiB of a {BUDGET_MIB} MiB budget, "
                  f"level changes {changes or 'none'}, "
                  f"over-budget events {over}")
        plot(runs, Path(args.out))
        print(f"plot: {args.out}")
        print("\n| shadow level | recovered from | recovery total (s) | start | init | resume "
              "| detect+stop+attach_repair |")
        print("|---|---|---|---|---|---|---|")
        for level in (3, 2, 1, None):
            e = recovery_run(Path(tmp) / f"rec-{level}", level)
            b = e["breakdown"]
            name = f"L{level}" if level else "no shadow (cold start)"
            via = f"L{e['shadow_level']} shadow" if e["promoted"] == "shadow" else "cold start"
            print(f"| {name} | {via} | {e['total_s']:.2f} | {b['start']:.2f} | {b['init']:.2f} | {b['resume']:.2f} | "
                  f"{b['detect'] + b['stop'] + b['attach_repair']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
