"""Issue 26: failures cluster, so the window after a promotion matters. ``leto train`` of the
tiny OLMoE recipe (Lightning, 2 ranks): an injected SIGKILL promotes the shadow set; 3 s after
that promotion a second SIGKILL from outside hits rank 1's new active trainer. The next shadow
set, forked from the node's warm template, is ready by then: the second recovery promotes it
too -- no cold start -- and the job finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from leto_lightning.runtime.events import read_events
from leto_lightning.testing.launched import stop, wait_for

SECOND_KILL_AFTER_S = 3.0


def _promoted(run_dir) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "shadows_promoted"]


def test_a_second_sigkill_soon_after_a_promotion_is_served_by_a_ready_shadow(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "leto_lightning.cli", "train", "olmoe", "size=tiny", "trainer.max_steps=140",
           "faults.hof_every=70", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, LETO_WANDB="0", PYTHONUNBUFFERED="1", LETO_WARM_TEMPLATE="1"))
    try:
        wait_for(lambda: run_dir.exists() and _promoted(run_dir), 240, "the injected fault's promotion")
        (promotion,) = _promoted(run_dir)
        time.sleep(max(0.0, promotion["time"] + SECOND_KILL_AFTER_S - time.time()))
        (victim,) = [e["pid"] for e in read_events(run_dir) if e["event"] == "process_started"
                     and e["role"] == "shadow" and e["shadow_set"] == promotion["shadow_set"] and e["rank"] == 1]
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 0, output[-3000:]
    events = read_events(run_dir)
    finished = [e for e in events if e["event"] == "recovery_finished" and not e.get("interrupted")]
    assert [e["promoted"] for e in finished] == ["shadow", "shadow"], finished
    killed = [e for e in events if e["event"] == "failure_detected"]
    assert killed[-1]["pid"] == victim and killed[-1]["signal"] == signal.SIGKILL
    replacements = [e for e in events if e["event"] == "process_started" and e["role"] == "shadow"
                    and e["shadow_set"] != "0-0"]
    assert replacements and all(e["forked"] for e in replacements), replacements
    (template,) = [e for e in events if e["event"] == "warm_template"]
    assert template["ready"], template
