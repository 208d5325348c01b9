"""Training loss with a HOF every 10 iterations, beside the fault-free run (paper Figure 12 analog).

One Lightning script (``leto_lightning/examples/lightning_tiny.py``: a tiny transformer LM,
``Trainer(strategy="leto", devices=2, accelerator="cpu")``) runs twice under ``leto launch
--nproc-per-node 2`` for ``--steps`` optimizer steps (default 100):

* the fault-free reference;
* the same run with a HOF in the update phase every ``--every`` iterations (default 10): a
  SIGKILL of one rank (alternating) at ``chunk.math_done`` of its 4th of 7 chunk transactions,
  at iterations 5, 15, 25, ...; each strikes once a fresh set of shadows is ready (the steady
  state of a long job). Each is recovered in place: the agent rolls the update forward and
  promotes the shadows.

The loss series is what CSVLogger wrote (``RUN_DIR/csv/version_0/metrics.csv``). The script
asserts that both series are equal value for value (and the final weights and optimizer state
of every rank bit-identical), prints them, and plots them to ``docs/figures/fig12_loss_hof.png``
(matplotlib, Agg). About 3 minutes on 2 shared cores (each HOF waits ~10 s for new shadows).

    python benchmarks/fig12_loss.py [--steps 100 --every 10 --out /tmp/fig12]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from leto_lightning.examples import LIGHTNING_TINY
from leto_lightning.runtime.events import read_events

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "docs" / "figures" / "fig12_loss_hof.png"


def launch(run_dir: Path, steps: int, faults: list[dict]) -> tuple[float, list[dict]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--faults", json.dumps(faults), LIGHTNING_TINY, "--max-steps", str(steps), "--page-bytes", "16384",
           "--checkpoint-every", "0"]
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=run_dir.parent, timeout=1800)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"leto launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return wall, read_events(run_dir)


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {int(r["step"]): float(r["train_loss"]) for r in rows}


def same_final_state(a: Path, b: Path) -> list[str]:
    diffs = []
    for rank in range(2):
        x = torch.load(a / f"final_rank{rank}.pt", weights_only=False)
        y = torch.load(b / f"final_rank{rank}.pt", weights_only=False)
        diffs += [f"rank {rank} param {n}" for n in x["params"] if not torch.equal(x["params"][n], y["params"][n])]
        sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
        diffs += [f"rank {rank} state {i}.{k}" for i in sx for k in sx[i]
                  if not torch.equal(torch.as_tensor(sx[i][k]), torch.as_tensor(sy[i][k]))]
    return diffs


def plot(reference: dict[int, float], faulty: dict[int, float], hofs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(reference)
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=150)
    ax.plot(steps, [reference[s] for s in steps], color="0.25", lw=2.2, label="fault-free")
    ax.plot(steps, [faulty[s] for s in steps], color="tab:red", lw=0, marker="o", ms=2.6,
            label=f"{len(hofs)} HOFs (update phase), recovered in place")
    for i, e in enumerate(hofs):
        ax.axvline(e["failed_iteration"], color="tab:red", alpha=0.25, lw=1, label="HOF" if i == 0 else None)
    ax.set_xlabel("iteration (optimizer step)")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss with a HOF every 10 iterations (2 ranks, CPU): identical to fault-free")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--figure", default=str(FIGURE))
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fig12-"))
    out.mkdir(parents=True, exist_ok=True)
    first = args.every // 2
    faults = [{"id": i, "rank": i % 2, "iteration": it, "point": "chunk.math_done", "occurrence": 4,
               "wait_shadows": True} for i, it in enumerate(range(first, args.steps, args.every))]

    wall_ref, _ = launch(out / "reference", args.steps, [])
    wall_hof, events = launch(out / "hofs", args.steps, faults)
    reference, faulty = losses(out / "reference"), losses(out / "hofs")
    hofs = [e for e in events if e["event"] == "recovery_finished" and not e.get("interrupted")]

    print(f"{'step':>4}  {'fault-free':>12}  {'with HOFs':>12}")
    for s in sorted(reference):
        mark = "  <- HOF" if any(e["failed_iteration"] == s for e in hofs) else ""
        print(f"{s:>4}  {reference[s]:>12.6f}  {faulty.get(s, float('nan')):>12.6f}{mark}")
    totals = ", ".join(f"{e['total_s']:.2f}" for e in hofs)
    print(f"\nruns: fault-free {wall_ref:.1f} s, with HOFs {wall_hof:.1f} s (wall, incl. start-up); "
          f"{len(hofs)} recoveries, time to the first step after each (s): {totals}")

    assert len(hofs) == len(faults), f"{len(hofs)} recoveries for {len(faults)} faults"
    assert all(e["promoted"] == "shadow" for e in hofs)
    assert sorted(reference) == list(range(args.steps)), "every step logged once"
    assert faulty == reference, "the loss series differ"
    diffs = same_final_state(out / "reference", out / "hofs")
    assert not diffs, diffs
    print(f"loss series equal at all {len(reference)} steps; final weights and optimizer state bit-identical")
    plot(reference, faulty, hofs, Path(args.figure))
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
