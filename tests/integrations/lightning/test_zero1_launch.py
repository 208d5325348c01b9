"""ZeRO-1 under ``leto launch``: a Lightning script (``zero1_launch_script.py``: the tiny example
with ``ZeroRedundancyOptimizer(AdamW)``, ``strategy="leto"``) under ``leto launch
--nproc-per-node 2`` with two real SIGKILLs -- an owner mid-update (a chunk's math done,
nothing committed), and an owner right after its commit, before ZeRO's broadcast (its peer's
replicas one step behind) -- each recovered in place by promoting the shadows, which bind views
only, wait, resume and refresh every replica from its owner. It ends bit-identical to the same
script under Lightning's own ``"ddp"`` with the same optimizer: every param, the owned AdamW
state, every logged loss."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lightning"))  # the launch harness
import zero1_launch_script
from launch_job import QUIET, Run, assert_nothing_left, same_state
from pl_job import run_ranks

from leto_lightning.testing import launched
from leto_lightning.updater.zero1 import COMMITTED_POINT

SCRIPT = str(Path(__file__).with_name("zero1_launch_script.py"))
STEPS = 10
ARGS = [SCRIPT, "--max-steps", str(STEPS), "--page-bytes", "16384", "--checkpoint-every", "0"]
FAULTS = [  # each strikes once a shadow set is ready
    {"id": 0, "rank": 1, "iteration": 2, "point": "chunk.math_done", "occurrence": 1, "wait_shadows": True},
    {"id": 1, "rank": 0, "iteration": 6, "point": COMMITTED_POINT, "occurrence": 1, "wait_shadows": True},
]


def _start(run_dir: Path) -> subprocess.Popen:
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--faults", json.dumps(FAULTS), *ARGS]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=QUIET,
                            cwd=run_dir.parent)


def _ddp_rank(run_dir: Path) -> None:
    """One rank of the reference, in a child forked from this interpreter (imports done once):
    the same script under Lightning's "ddp", ranks started by hand (``pl_job.run_ranks``)."""
    sys.argv = [*ARGS, "--strategy", "ddp", "--out", str(run_dir)]
    zero1_launch_script.main()


def test_zero1_under_launch_two_hofs_bit_identical_to_ddp(tmp_path: Path) -> None:
    run_ranks(lambda rank: _ddp_rank(tmp_path / "ddp"), world=2, timeout=180)
    run = launched.finish(_start(tmp_path / "run"), tmp_path / "run", timeout=240, result=Run)
    ddp = Run(0, "", tmp_path / "ddp", [])
    assert run.returncode == 0, run.output[-4000:]
    finished = [e for e in run.of("recovery_finished") if not e.get("interrupted")]
    assert len(finished) == 2 and all(e["promoted"] == "shadow" for e in finished), [
        (e["event"], e.get("reason")) for e in run.events]
    assert [e["signal"] for e in run.of("failure_detected")] == [signal.SIGKILL] * 2
    assert not run.of("fallback_checkpoint") and not run.of("cold_start")
    for rank in range(2):
        final = run.final(rank)
        assert final["optimizer"]["state"], f"rank {rank} owns nothing"
        assert same_state(final, ddp.final(rank)) == [], f"rank {rank}"
        assert final["global_step"] == STEPS
    assert all(v.equal(run.final(1)["params"][n]) for n, v in run.final(0)["params"].items())
    train = [s[2] for s in run.loss_series() if s[2]]
    assert len(train) == STEPS and run.loss_series() == ddp.loss_series()
    assert_nothing_left(run)
