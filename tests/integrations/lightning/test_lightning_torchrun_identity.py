"""The same user-written Lightning script (``user_script.py``: LayerNorm, attention, dropout,
a cosine schedule, clipping, validation) under ``torchrun --nproc-per-node 2`` with
``strategy="ddp"`` and under ``leto launch --nproc-per-node 2`` with ``strategy="leto"``, no
failure: weights, optimizer state and every step's loss are bit-identical.

The test sets no thread variable: it removes every one from the environment it passes, so
each launcher's own convention decides (torchrun sets ``OMP_NUM_THREADS=1`` per worker when
it is unset and runs more than one per node, and so must ``leto launch``; with the
trainers on all cores LayerNorm's gradients differ by an ulp from the first step).

About 40 s on 2 shared cores (two launches of two or four processes each).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from leto_lightning.testing import launched

SCRIPT = str(Path(__file__).with_name("user_script.py"))
STEPS = 12
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS")
OMP_NOTICE = "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default"


def _env() -> dict[str, str]:
    drop = THREAD_VARS + ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                          "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("LETO_", "TORCHELASTIC_"))}
    return dict(env, PYTHONWARNINGS="ignore")


def _run(cmd: list[str], cwd: Path, timeout: float = 240) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-5000:]
    return out


def _final(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def _differences(a: dict, b: dict) -> list[str]:
    diffs = [f"param {n}" for n in b["params"] if not torch.equal(a["params"][n], b["params"][n])]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    diffs += [f"optimizer state {i}.{k}" for i in sb for k, v in sb[i].items()
              if not torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(v))]
    if a["optimizer"]["param_groups"][0]["lr"] != b["optimizer"]["param_groups"][0]["lr"]:
        diffs.append("lr")
    if not torch.equal(a["losses"], b["losses"]):
        diffs.append(f"losses {a['losses'].tolist()} != {b['losses'].tolist()}")
    return diffs


def test_leto_launch_equals_torchrun_ddp(tmp_path) -> None:
    ddp_out, leto_out, run_dir = tmp_path / "ddp", tmp_path / "leto", tmp_path / "run"
    torchrun = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     SCRIPT, "--strategy", "ddp", "--out", str(ddp_out), "--max-steps", str(STEPS)], tmp_path)
    leto = _run([sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir",
                 str(run_dir), SCRIPT, "--strategy", "leto", "--out", str(leto_out), "--max-steps", str(STEPS)],
                tmp_path)
    assert OMP_NOTICE in torchrun and OMP_NOTICE in leto  # the same convention, the same notice
    run = launched.LaunchedRun(0, leto, run_dir, launched.read_events(run_dir))
    assert not launched.leftovers(run), launched.leftovers(run)
    assert not run.of("failure_detected")
    for rank in range(2):
        ddp, ours = _final(ddp_out, rank), _final(leto_out, rank)
        assert ddp["threads"] == ours["threads"] == 1
        assert ddp["global_step"] == ours["global_step"] == STEPS
        assert len(ours["losses"]) == STEPS
        assert _differences(ours, ddp) == [], f"rank {rank}"
    assert not torch.equal(_final(ddp_out, 0)["losses"], _final(ddp_out, 1)["losses"])  # the ranks see other data
