"""``Trainer(strategy="leto_fsdp2")`` under ``leto launch --nproc-per-node 2``: five SIGKILLs at
seeded random points in ONE run -- mid-update (in the chunk transactions), both ranks at once
during a tier-2 parity update and again mid-update -- each failure recovered in place by
promoting the shadows (which bound views of the FSDP2 shards and waited, fully built); with
LETO_LONG=1 also six SIGKILLs incl. an epoch boundary and the start of a step's compute. The
job exits 0, and every rank's final local shards, AdamW state and every loss are bit-identical
to Lightning's own ``ModelParallelStrategy`` without failures. A recovery itself takes ~0.3 s;
the test's time (~1 min on 2 shared cores) is the trainer and shadow processes starting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_fsdp2_job import WORLD, loss_series
from test_lightning_fsdp2 import run

from leto_lightning.faults.plan import planned_faults
from leto_lightning.testing import launched

JOB = Path(__file__).with_name("lightning_fsdp2_job.py")
STEPS = 12  # 4 steps per epoch: epochs end after steps 3 and 7
QUIET = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


# (ranks, point, iterations, occurrences per iteration); each strikes once fresh shadows are ready
CI_PLAN = [  # five SIGKILLs, three recoveries (each recovery starts a new shadow set: ~8 s on 2 cores)
    ([1], "chunk.math_done", (1, 2), 3),  # mid-update
    ([0, 1], "chunk.tier2_partial", (4, 6), 3),  # both ranks at once, mid-parity-update
    ([0, 1], "chunk.math_done", (9, 10), 3),  # both ranks at once, mid-update
]
LONG_PLAN = [  # six SIGKILLs, five recoveries
    ([1], "chunk.math_done", (1, 2), 3),
    ([0], "lightning.epoch_end", (3, 3), 1),  # at an epoch boundary
    ([1], "chunk.tier2_partial", (5, 6), 3),
    ([0], "compute.begin", (8, 8), 1),  # as a step's compute begins
    ([0, 1], "chunk.math_done", (10, 10), 3),
]


def hof_faults(seed: int, plan: list) -> list[dict]:
    """The plan's failures at seeded iterations and occurrences."""
    return planned_faults(plan, seed)


def launch(run_dir: Path, out: Path, faults: list[dict]) -> launched.LaunchedRun:
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", str(WORLD), "--run-dir",
           str(run_dir), "--faults", json.dumps(faults), str(JOB), "--steps", str(STEPS), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=QUIET,
                            cwd=run_dir.parent)
    return launched.finish(proc, run_dir, timeout=300)


def check_hofs(tmp_path: Path, plan: list) -> None:
    faults = hof_faults(int(os.environ.get("LETO_SEED", "0")), plan)
    result = launch(tmp_path / "run", tmp_path / "out", faults)
    assert result.returncode == 0, result.output[-5000:]
    finished = [e for e in result.of("recovery_finished") if not e.get("interrupted")]
    assert len(finished) == len(plan), [(e["event"], e.get("reason")) for e in result.events]
    assert all(e["promoted"] == "shadow" for e in finished)
    assert not result.of("fallback_checkpoint") and not result.of("cold_start")
    assert [e["signal"] for e in result.of("failure_detected")] == [signal.SIGKILL] * len(plan)
    plain = run(tmp_path, "plain", leto=False, steps=STEPS)
    for rank in range(WORLD):
        leto = torch.load(tmp_path / "out" / f"r{rank}.pt")
        a = plain[rank]
        assert leto["iteration"] == STEPS == leto["global_step"] == a["global_step"]
        for i, (x, y) in enumerate(zip(a["params"], leto["params"], strict=True)):
            assert torch.equal(x, y), f"rank {rank}: param {i} differs"
        for i, (x, y) in enumerate(zip(a["state"], leto["state"], strict=True)):
            assert all(torch.equal(x[k], y[k]) for k in x), f"rank {rank}: param {i}: AdamW state differs"
        series = loss_series(str(tmp_path / "out" / f"losses{rank}.txt"))
        assert series == loss_series(str(tmp_path / "plain" / f"losses{rank}.txt"))
        assert len(series) == STEPS * 2


def test_five_sigkills_under_leto_launch_bit_identical_to_model_parallel_strategy(tmp_path) -> None:
    assert sum(len(ranks) for ranks, *_ in CI_PLAN) == 5
    check_hofs(tmp_path, CI_PLAN)


@pytest.mark.slow
def test_six_sigkills_incl_epoch_end_and_compute(tmp_path) -> None:
    check_hofs(tmp_path, LONG_PLAN)
