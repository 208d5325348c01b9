"""Recovery time: Leto's in-place recovery against full restarts (the paper's Table 3 analog).

One invocation, one machine, one training job: the 2-rank gloo data-parallel loop of
``leto_lightning/examples/plain_ddp.py`` (TinyLM, AdamW, deterministic batches). Each system
runs it until a SIGKILL hits rank ``--fail-rank`` at iteration ``--fail-at``, recovers, and
goes on; we measure the time from the failure to the first iteration completed after it,
with the breakdown (docs/benchmarks/recovery.md):

* ``leto-update``  -- ``leto launch`` with L3 shadows, SIGKILL in the middle of the optimizer
  update (the ``chunk.math_done`` point of the middle chunk); ``recovery_finished`` of
  RUN_DIR/events.jsonl gives ``total_s`` (failure -> first completed iteration after it,
  which after a roll-forward is the *next* iteration) and the breakdown;
* ``leto-compute`` -- the same, SIGKILL at the start of the compute phase (the iteration is
  lost and recomputed);
* ``disk``         -- checkpoint-restart: plain torch processes (benchmarks/baselines/), a
  ``torch.save`` checkpoint every K iterations, SIGKILL, every rank killed and restarted,
  ``torch.load``, the lost iterations recomputed until the failed one is done again;
* ``shm``          -- Gemini-style: the same, with the checkpoint in host memory (POSIX shared
  memory that survives the processes);
* ``shm-spare``    -- Gemini+: ``shm`` with pre-warmed spare processes (torch imported, model
  and optimizer built, waiting for a rank).

All systems use the same checkpoint interval K (``--checkpoint-every``, default 11, the
interval the paper tuned for Gemini on Kimi-MoE); the default failure point is the middle of
an interval (K + (K-1)/2), whose recompute is the expected value over uniformly distributed
failure points. The systems run interleaved (the order rotates per repeat); the table gives
medians over ``--repeats``. Every process is ended by pid and every shared-memory segment
created by the run is checked to be gone.

    python benchmarks/recovery.py                  # defaults: 3 repeats, ~5-6 min on 2 shared cores
    python benchmarks/recovery.py --repeats 1 --systems leto-compute,shm   # smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from baselines.restart import Fault, RestartJob

from leto_lightning.env import JOB_PREFIX
from leto_lightning.examples import PLAIN_DDP
from leto_lightning.retained.shm import list_segments
from leto_lightning.runtime.events import iter_events, read_events
from leto_lightning.runtime.procs_state import is_alive

SYSTEMS = ("leto-update", "leto-compute", "disk", "shm", "shm-spare")
LABELS = {
    "leto-update": "Leto, SIGKILL mid-update",
    "leto-compute": "Leto, SIGKILL in compute",
    "disk": "checkpoint-restart (disk)",
    "shm": "Gemini (in-memory ckpt)",
    "shm-spare": "Gemini+ (in-memory ckpt, spares)",
}
COLUMNS = ("detect", "stop", "restart", "init", "load", "recompute", "other")
PAPER = {"Gemini (11)": 127, "Gemini+ (11)": 88, "Leto (11)": 19}  # Table 3, Kimi-MoE, seconds


# -- Leto ----------------------------------------------------------------------------------
def mid_update_occurrence(dim: int) -> int:
    """The middle chunk of plain_ddp.py's retained layout (its RetainedConfig, copied here)."""
    from leto_lightning.models.tiny import TinyLM
    from leto_lightning.retained.config import RetainedConfig
    from leto_lightning.updater.retained_optimizer import layout_for

    torch.manual_seed(0)
    model = TinyLM(vocab=97, dim=dim)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    cfg = RetainedConfig(page_bytes=16384, data_pages=4, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)
    return max(1, layout_for(opt, cfg).n_chunks // 2)




def _logged(run_dir: str, rank: int, iteration: int) -> bool:
    try:
        return any(json.loads(line)["it"] == iteration for line in open(os.path.join(run_dir, f"loss_rank{rank}.jsonl"))
                   if line.endswith("\n"))
    except (OSError, ValueError):
        return False


def run_leto(variant: str, args, run_dir: str, occurrence: int) -> dict:
    fault = {"id": 0, "rank": args.fail_rank, "iteration": args.fail_at, "wait_shadows": True}
    fault.update({"point": "chunk.math_done", "occurrence": occurrence} if variant == "update"
                 else {"point": "compute.begin"})
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", run_dir,
           "--faults", json.dumps([fault]), PLAIN_DDP, "--iterations", str(args.iterations or args.fail_at + 2),
           "--sleep", str(args.sleep), "--dim", str(args.dim), "--checkpoint-every", str(args.checkpoint_every)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.leto_threads))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "output.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline, measured = time.time() + args.timeout, None
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
            if measured is None and any(e["event"] == "recovery_finished" for e in iter_events(run_dir)):
                measured = time.time()
            if measured is not None and (time.time() - measured > 5 or all(
                    _logged(run_dir, r, args.fail_at) for r in range(2))):
                break  # the loss of the failed iteration is logged too (the losses are compared)
        if proc.poll() is None:  # measured (or out of time): stop the job, don't wait for its last iterations
            os.kill(proc.pid, signal.SIGTERM)  # the agent kills its trainers and unlinks its segments
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        rc = proc.returncode
    events = read_events(run_dir)
    pids = [e["pid"] for e in events if e["event"] in ("process_started", "job_started")]
    left = [p for p in pids if is_alive(p)]
    for p in left:  # only processes this run started, by pid
        os.kill(p, signal.SIGKILL)
    ended = any(e["event"] in ("job_finished", "job_interrupted") for e in events)
    if rc not in (0, 128 + signal.SIGTERM) or not ended:
        raise RuntimeError(f"leto launch ({variant}) ended with {rc}; see {run_dir}/output.log")
    finished = [e for e in events if e["event"] == "recovery_finished" and not e.get("interrupted")]
    if len(finished) != 1 or any(e["event"] == "fallback_checkpoint" for e in events):
        raise RuntimeError(f"leto ({variant}): expected one in-place recovery, got {[e['event'] for e in events]}")
    (rec,) = finished
    bd = rec["breakdown"]
    # Same clock as the baselines: stop when the *failed* iteration is complete again. After a
    # mid-update failure that is the roll-forward, before the first new iteration (which the
    # agent's total_s includes).
    if rec["resume_iteration"] > rec["failed_iteration"]:
        rec = dict(rec, total_s=rec["total_s"] - rec["first_iteration_s"])
    row = {"detect": bd["detect"], "stop": bd["stop"], "restart": 0.0 if rec["promoted"] == "shadow" else float("nan"),
           "init": bd["init"], "load": bd["attach_repair"] + bd["resume"], "recompute": bd["recompute"]}
    row["other"] = max(0.0, rec["total_s"] - sum(v for v in row.values() if v == v))
    losses = {r: {} for r in range(2)}
    for r in range(2):
        for line in open(os.path.join(run_dir, f"loss_rank{r}.jsonl")):
            e = json.loads(line)
            losses[r][e["it"]] = e["loss"]
    return {"total": rec["total_s"], "row": row, "left": left, "losses": losses,
            "detail": {"promoted": rec["promoted"], "failed_iteration": rec["failed_iteration"],
                       "resume_iteration": rec["resume_iteration"], "first_iteration_s": rec["first_iteration_s"],
                       "repair": rec.get("repair")}}


def run_baseline(mode: str, args, run_dir: str) -> dict:
    job = RestartJob(mode, run_dir, args.iterations or args.fail_at + 1, Fault(args.fail_rank, args.fail_at, "update"),
                     dim=args.dim, sleep=args.sleep, checkpoint_every=args.checkpoint_every)
    r = job.run(timeout=args.timeout)
    left = [p for p in r.pids if is_alive(p)]
    row = dict(r.breakdown)
    row["other"] = r.total_s - sum(row.values())
    return {"total": r.total_s, "row": row, "left": left, "losses": r.losses,
            "detail": {"checkpoint_iteration": r.checkpoint_iteration, "failed_iteration": r.failed_iteration,
                       "recomputed_iterations": r.recomputed_iterations, "iteration_s": r.iteration_s,
                       "imports_s": r.imports_s, "pg_s": r.pg_s}}


# -- report --------------------------------------------------------------------------------
def fmt(x: float) -> str:
    return "–" if x != x else f"{x:.2f}"


def median_run(runs: list[dict]) -> dict:
    """The run with the median total (its breakdown adds up, unlike per-column medians)."""
    return sorted(runs, key=lambda r: r["total"])[(len(runs) - 1) // 2]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Runs Leto and the full-restart baselines interleaved on the same "
        "2-rank training script and prints the recovery time, its breakdown and the ratios.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of every system (the table shows medians)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--checkpoint-every", type=int, default=11, help="checkpoint interval K (iterations), all systems")
    p.add_argument("--fail-at", type=int, default=None,
                   help="iteration of the SIGKILL (default: K + (K-1)//2, the middle of the second interval)")
    p.add_argument("--fail-rank", type=int, default=1, choices=(0, 1))
    p.add_argument("--iterations", type=int, default=None,
                   help="iterations per job (default: --fail-at + 2 for Leto, + 1 for the baselines: a run stops "
                        "right after the recovery is measured)")
    p.add_argument("--dim", type=int, default=256, help="TinyLM width (model size): 256 = 0.58M parameters")
    p.add_argument("--sleep", type=float, default=0.4, help="extra seconds per iteration (all systems)")
    p.add_argument("--leto-threads", type=int, default=1,
                   help="OMP_NUM_THREADS for `leto launch` (its agent does the roll-forward; trainers use 1 anyway)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per job before it is stopped")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories (events, timelines, logs)")
    args = p.parse_args()
    k = args.checkpoint_every
    if args.fail_at is None:
        args.fail_at = k + (k - 1) // 2
    if args.iterations is not None and args.iterations < args.fail_at + 2:
        p.error("--iterations must be at least --fail-at + 2")
    if args.fail_at < k:
        p.error(f"--fail-at {args.fail_at} comes before the first checkpoint (K={k})")
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")

    prefix = "rb" + secrets.token_hex(4) + "x"  # every segment this run creates starts with leto-<prefix>
    os.environ[JOB_PREFIX] = prefix
    root = tempfile.mkdtemp(prefix="leto-recovery-bench-")
    position = args.fail_at % k
    t_start = time.time()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    print(f"TinyLM dim {args.dim}, 2 ranks (gloo), AdamW, --sleep {args.sleep} s per iteration; checkpoint every "
          f"K={k} iterations; SIGKILL rank {args.fail_rank} at iteration {args.fail_at} (position {position} of "
          f"0..{k - 1} in its interval); {args.repeats} repeat(s), interleaved", flush=True)
    occurrence = mid_update_occurrence(args.dim) if "leto-update" in systems else 0
    if occurrence:
        print(f"Leto mid-update fault: chunk.math_done occurrence {occurrence} (the middle chunk of rank "
              f"{args.fail_rank}'s update)", flush=True)

    results: dict[str, list[dict]] = {s: [] for s in systems}
    leftovers: list[int] = []
    try:
        for rep in range(args.repeats):
            order = systems[rep % len(systems):] + systems[: rep % len(systems)]
            for system in order:
                run_dir = os.path.join(root, f"{system}-{rep}")
                t0 = time.time()
                if system.startswith("leto-"):
                    res = run_leto(system.split("-", 1)[1], args, run_dir, occurrence)
                else:
                    res = run_baseline(system, args, run_dir)
                leftovers += res["left"]
                results[system].append(res)
                row = " ".join(f"{c} {fmt(res['row'][c])}" for c in COLUMNS)
                print(f"  repeat {rep + 1} {system:13s} recovery {res['total']:6.2f} s   [{row}]   "
                      f"(job {time.time() - t0:.0f} s)", flush=True)
    finally:
        segments = list_segments("leto-" + prefix)
        for name in segments:  # should be none: report, then remove
            from leto_lightning.retained.shm import unlink_segment

            unlink_segment(name)
        if not args.keep_runs:
            shutil.rmtree(root, ignore_errors=True)

    # -- the table ---------------------------------------------------------------------------
    med = {s: median_run(runs) for s, runs in results.items() if runs}
    leto = [s for s in ("leto-update", "leto-compute") if s in med]
    baselines = [s for s in ("disk", "shm", "shm-spare") if s in med]
    print()
    head = ["system", "recovery s", "runs (s)"] + list(COLUMNS) + [f"/ {s}" for s in leto]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for s, runs in results.items():
        m = med[s]
        cells = [LABELS[s], f"**{m['total']:.2f}**", " / ".join(f"{r['total']:.2f}" for r in runs)]
        cells += [fmt(m["row"][c]) for c in COLUMNS]
        cells += [f"{m['total'] / med[name]['total']:.1f}×" for name in leto]
        print("| " + " | ".join(cells) + " |")
    print()
    print("Columns: detect = SIGKILL -> noticed; stop = survivors killed and reaped; restart = new processes up to "
          "`import torch` done (0 for a promoted shadow; for Gemini+ the hand-over to a spare); init = process group, "
          "model, optimizer (Leto: what the shadow still had to build); load = checkpoint -> model/optimizer (Leto: "
          "attach + undo/repair/roll-forward of retained state + resume); recompute = iterations redone until the "
          "failed one is complete again (every system: the clock stops when the failed iteration is complete; after "
          "a mid-update failure Leto's roll-forward completes it); other = the rest of the total. Breakdown of the "
          "median run.")
    for s in baselines:
        d = median_run(results[s])["detail"]
        rest = ("the model and AdamW were built by the spare beforehand" if s == "shm-spare" else
                "the rest building the model + AdamW (whose first construction imports torch._dynamo)")
        print(f"  {LABELS[s]}: checkpoint at iteration {d['checkpoint_iteration']}, {d['recomputed_iterations']} "
              f"iterations recomputed ({d['iteration_s']:.2f} s each, fault-free); restart: interpreter + "
              f"`import torch` {d['imports_s']:.2f} s; init: init_process_group {d['pg_s']:.2f} s, {rest}")
    for s in leto:
        d = median_run(results[s])["detail"]
        print(f"  {LABELS[s]}: promoted {d['promoted']}, failed in iteration {d['failed_iteration']}, resumed at "
              f"{d['resume_iteration']}, first iteration after resuming {d['first_iteration_s']:.2f} s")

    if leto and baselines:
        best = min(baselines, key=lambda s: med[s]["total"])
        print()
        for s in leto:
            x = med[best]["total"] / med[s]["total"]
            print(f"Leto is {x:.1f}x faster than the best baseline ({LABELS[best]}, {med[best]['total']:.2f} s): "
                  f"{LABELS[s]}, {med[s]['total']:.2f} s; 6.5x target {'met' if x >= 6.5 else 'NOT met'}")
        print("  (--sleep stands for compute time: both training scripts sleep inside the compute phase, so a "
              "recomputed iteration pays it too)")
        print(f"\nWhere the failure lands in the K={k} interval (measured at position {position}; recompute grows by "
              f"one iteration per position, iteration times as measured):")
        for s in baselines:
            m = med[s]
            t_it = m["detail"]["iteration_s"]
            cells = []
            for pos in (0, (k - 1) // 2, k - 1):
                total = m["total"] + (pos - position) * t_it
                ratios = ", ".join(f"{total / med[name]['total']:.1f}x" for name in leto)
                cells.append(f"position {pos}: {total:.2f} s ({ratios} Leto)")
            print(f"  {LABELS[s]}: " + "; ".join(cells))
        print(f"  (uniform failure positions: the expected recompute is that of position {(k - 1) / 2:g}"
              f"{', the middle, as measured' if position == (k - 1) / 2 else ''})")
        gem, gemp, lt = PAPER["Gemini (11)"], PAPER["Gemini+ (11)"], PAPER["Leto (11)"]
        print(f"\nPaper, Table 3 (Kimi-MoE, A100s, interval 11): Gemini {gem} s, Gemini+ {gemp} s, Leto {lt} s -> "
              f"{gemp / lt:.1f}x the best baseline ({gem / lt:.1f}x Gemini)")

    # -- checks --------------------------------------------------------------------------------
    print()
    ref_sys = next(iter(r for r in results.values() if r))
    ref = ref_sys[0]["losses"]
    upto = args.fail_at + 1
    mismatched = [f"{s} #{i + 1}" for s, runs in results.items() for i, run in enumerate(runs)
                  if any(run["losses"][r].get(it) != ref[r].get(it) for r in range(2) for it in range(upto))]
    print(f"same training in every run (losses of iterations 0..{args.fail_at}, both ranks, bit-identical): "
          f"{'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}")
    print(f"processes left running: {leftovers or 'none'}; shared-memory segments left (leto-{prefix}*): "
          f"{segments or 'none'}")
    print(f"wall-clock {time.time() - t_start:.0f} s, load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
