"""The end-to-end ``leto demo``: tiny OLMoE on 2 CPU ranks with Leto, HOFs injected.

Runs the recipe twice -- fault-free, then with a HOF every ``--hof-every`` iterations (one of
them mid-update) -- prints each recovery as it happens, and ends with a summary: recoveries
with their breakdown, ETTR, whether the final weights and optimizer state are bit-identical to
the fault-free run, a loss plot and the wandb offline run.
"""

from __future__ import annotations

import io
import time
from pathlib import Path


class _RecoveryEcho(io.TextIOBase):
    """The agent's output, filtered: rank chatter hidden, Leto's own lines shown as they come."""

    def __init__(self, console) -> None:
        self.console = console

    def write(self, text: str) -> int:
        # Survivors' "connection closed by peer" tracebacks are expected after a SIGKILL: hidden.
        for line in text.splitlines():
            if line.startswith("[leto]"):
                self.console.print(line, style="cyan", markup=False, highlight=False)
        return len(text)


def run_demo(steps: int, hof_every: int, run_dir: str) -> int:
    from rich.console import Console

    from ..train import build_agent

    console = Console()
    base = Path(run_dir)
    common = ["size=tiny", f"trainer.max_steps={steps}", "trainer.val_check_interval=10"]
    console.print(f"[bold]leto demo[/]: tiny OLMoE (MoE, top-2 of 8 experts), 2 CPU ranks, {steps} iterations\n"
                  f"1) fault-free reference run -> {base / 'reference'}")
    t0 = time.time()
    rc = build_agent("olmoe", common, str(base / "reference"), out=_RecoveryEcho(console)).run()
    if rc != 0:
        console.print(f"[red]reference run failed (exit {rc})[/]")
        return rc
    console.print(f"   done in {time.time() - t0:.0f} s\n2) the same run with a HOF every {hof_every} iterations "
                  f"(SIGKILL of a trainer mid-update) -> {base / 'faulty'}")
    rc = build_agent("olmoe", common + [f"faults.hof_every={hof_every}", "faults.hof_phase=update"],
                     str(base / "faulty"), out=_RecoveryEcho(console)).run()
    if rc != 0:
        console.print(f"[red]faulty run failed (exit {rc})[/]")
        return rc
    return summarize(console, base)


def summarize(console, base: Path) -> int:
    import torch
    from rich.table import Table

    from ..runtime.event_types import JobFinished, JobStarted, RecoveryFinished
    from ..runtime.events import read_typed_events

    events = read_typed_events(base / "faulty")
    table = Table(title="recoveries: breakdown in seconds (fail/res: iterations)", box=None, show_edge=False,
                  padding=(0, 1), pad_edge=False)  # 12 columns in 80
    for col in ("gen", "fail", "res", "detect", "stop", "repair", "start", "init", "resume", "recomp", "next",
                "total"):
        table.add_column(col, justify="right", min_width=len(col))
    lost = 0.0
    for e in (e for e in events if isinstance(e, RecoveryFinished) and not e.interrupted):
        b = e.breakdown
        lost += e.total_s or 0.0
        table.add_row(str(e.generation), str(e.failed_iteration), str(e.resume_iteration),
                      *(f"{b.get(k, 0.0):.2f}" for k in ("detect", "stop", "attach_repair", "start", "init", "resume",
                                                         "recompute", "next_iteration")),
                      f"{e.total_s or 0.0:.2f}")
    console.print(table)
    console.print("total = failure -> first completed iteration after it (shadows promoted; "
                  "'repair' = attach retained state, undo the torn chunk, repair, roll forward)")
    start = next(e.time for e in events if isinstance(e, JobStarted))
    end = next(e.time for e in events if isinstance(e, JobFinished))
    ettr = 1 - lost / (end - start)
    same = all(_same(base / "faulty" / f"final_rank{r}.pt", base / "reference" / f"final_rank{r}.pt", torch)
               for r in (0, 1))
    plot = _plot(base)
    console.print(f"ETTR (productive time / wall time of the faulty run): [bold]{ettr:.1%}[/]")
    console.print(f"final weights and optimizer state bit-identical to the fault-free run: "
                  f"{'[green]yes[/]' if same else '[red]NO[/]'} (torch.equal, both ranks)")
    console.print(f"loss plot: {plot}\nwandb offline runs: {base / 'faulty' / 'wandb'} (wandb sync to upload)")
    return 0 if same else 1


def _same(a: Path, b: Path, torch) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    params = all(torch.equal(p, q) for p, q in zip(x["params"], y["params"]))
    sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
    return params and all(torch.equal(sx[i][k], sy[i][k]) for i in sy for k in sy[i] if torch.is_tensor(sy[i][k]))


def _losses(run: Path) -> dict[int, float]:
    import csv

    out = {}
    for path in run.glob("csv/version_0/metrics.csv"):
        for row in csv.DictReader(open(path)):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def _plot(base: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref, faulty = _losses(base / "reference"), _losses(base / "faulty")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(list(ref), list(ref.values()), label="fault-free", lw=3, alpha=0.5)
    ax.plot(list(faulty), list(faulty.values()), "--", label="with HOFs (Leto)", lw=1.5)
    from ..runtime.event_types import FailureDetected
    from ..runtime.events import read_typed_events

    for e in read_typed_events(base / "faulty"):
        if isinstance(e, FailureDetected) and e.iteration is not None:
            ax.axvline(e.iteration, color="red", lw=0.8, alpha=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title("tiny OLMoE, 2 CPU ranks: HOFs (red) vs fault-free")
    path = base / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
