"""Run ``leto launch`` as a real subprocess and read what it left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from leto_lightning.examples import PLAIN_DDP
from leto_lightning.testing import launched
from leto_lightning.testing.launched import LaunchedRun, free_port, stop, wait_for  # noqa: F401  (re-exported)


class LaunchResult(LaunchedRun):
    """A plain-PyTorch example's run (``examples/plain_ddp.py``, ``examples/plain_fsdp2.py``)."""

    def losses(self, rank: int) -> dict[int, float]:
        """Loss per iteration; a recomputed iteration keeps its last value."""
        out = {}
        for line in open(self.run_dir / f"loss_rank{rank}.jsonl"):
            rec = json.loads(line)
            out[rec["it"]] = rec["loss"]
        return out


def launch_args(run_dir: Path, iterations: int, faults=(), extra=(), script_args=(), nproc: int = 2,
                script: str = PLAIN_DDP) -> list[str]:
    """``leto launch`` of a plain-PyTorch example (``examples/plain_ddp.py`` unless ``script``)."""
    return [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", str(nproc),
            "--run-dir", str(run_dir), "--faults", json.dumps(list(faults)), *extra,
            script, "--iterations", str(iterations), *script_args]


def start(run_dir: Path, iterations: int, **kw) -> subprocess.Popen:
    return subprocess.Popen(launch_args(run_dir, iterations, **kw), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> LaunchResult:
    return launched.finish(proc, run_dir, timeout, result=LaunchResult)


def run(run_dir: Path, iterations: int, **kw) -> LaunchResult:
    return finish(start(run_dir, iterations, **kw), run_dir)


def same_state(a: dict, b: dict) -> list[str]:
    diffs = [f"param {i}" for i, (x, y) in enumerate(zip(a["params"], b["params"])) if not torch.equal(x, y)]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    diffs += [f"state {i}.{k}" for i in sb for k in sb[i] if not torch.equal(sa[i][k], sb[i][k])]
    return diffs
