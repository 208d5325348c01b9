"""Measure the mean training-iteration time of every tiny recipe on this machine.

Why: the simulator's iteration-time model is validated against what the project measures;
these are the smallest such measurements, taken on the CPU the tests run on.

One iteration = what one data-parallel rank does per optimizer step of the tiny form:
``grad_accumulation`` micro-batches of ``micro_batch`` sequences (forward, cross-entropy +
aux loss, backward), gradient clipping and the AdamW step, in plain torch (no Lightning
loop overhead, which is measured by the integration benchmarks).

Usage::

    python benchmarks/tiny_step_time.py                 # all tiny recipes, 1 thread
    python benchmarks/tiny_step_time.py --steps 50 --threads 2 --out /tmp/t.json

Default one intra-op thread: a tiny run has dp=2 ranks on a 2-core machine, one core each.
Each recipe is timed ``--repeats`` times and the lowest mean is kept, so another job that
briefly shares the cores inflates one repeat, not the result.

Writes ``docs/sim/measured_tiny.json`` as ``{recipe: seconds_per_iteration}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from leto_lightning.models.config import count_parameters, list_recipes, load_recipe
from leto_lightning.models.data import make_dataloaders
from leto_lightning.models.lightning_module import MoELanguageModel

REPO = Path(__file__).resolve().parents[1]


def time_recipe(name: str, steps: int, warmup: int) -> list[float]:
    """Per-iteration wall times (seconds) of ``steps`` iterations after ``warmup`` ones."""
    recipe = load_recipe(name, ["size=tiny"])
    module = MoELanguageModel.from_recipe(recipe)
    optimizer = module.configure_optimizers()
    train, _ = make_dataloaders(recipe, train_sequences=64)
    batches = list(train)
    accumulate = recipe.active.grad_accumulation * recipe.trainer.accumulate_grad_batches
    clip = recipe.trainer.gradient_clip_val
    times: list[float] = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        for micro in range(accumulate):
            loss, _, _ = module._losses(batches[(step * accumulate + micro) % len(batches)])
            (loss / accumulate).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed iterations per recipe")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="keep the lowest mean of these")
    parser.add_argument("--recipes", nargs="*", default=None, help="default: all with a tiny form")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "sim" / "measured_tiny.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.recipes or [n for n in list_recipes() if load_recipe(n).tiny is not None]
    results: dict[str, float] = {}
    print(f"threads={args.threads} steps={args.steps} repeats={args.repeats} "
          f"load={os.getloadavg()[0]:.2f}")
    print(f"{'recipe':14s} {'params':>9s} {'active':>9s} {'mean s/it':>10s} {'median':>9s} {'50 it (s)':>9s}")
    for name in names:
        runs = [time_recipe(name, args.steps, args.warmup) for _ in range(args.repeats)]
        times = min(runs, key=statistics.fmean)
        model = load_recipe(name).tiny.model
        total, active = count_parameters(model)
        mean = statistics.fmean(times)
        results[name] = round(mean, 5)
        print(f"{name:14s} {total:9,d} {active:9,d} {mean:10.4f} {statistics.median(times):9.4f} "
              f"{50 * mean:9.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
