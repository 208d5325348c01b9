"""`python train.py` with `Trainer(strategy="leto", devices=2)`: the process becomes the ranks'
supervisor (re-runs itself under `leto launch`), so a killed rank is recovered in place."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

from leto_lightning.examples import LIGHTNING_TINY


def _events(cwd):
    files = glob.glob(str(cwd / "leto-runs" / "*" / "events.jsonl"))
    return [json.loads(line) for f in files for line in open(f) if line.strip()]


def test_python_train_py_is_supervised_and_recovers(tmp_path):
    proc = subprocess.Popen([sys.executable, LIGHTNING_TINY, "--max-steps", "24", "--sleep", "0.2"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            ev = _events(tmp_path)
            if any(e["event"] == "shadow_level" and e.get("reason") == "ready" for e in ev):
                break
            time.sleep(0.2)
        active = [e["pid"] for e in _events(tmp_path) if e["event"] == "process_started" and e["role"] == "active"]
        time.sleep(1.0)
        os.kill(active[-1], signal.SIGKILL)  # from outside, found through the run dir's event log
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert "re-running this script under `leto launch --nproc-per-node 2" in out
    ev = _events(tmp_path)
    assert any(e["event"] == "recovery_finished" for e in ev)
    assert any(e["event"] == "job_finished" for e in ev)
    pids = [e["pid"] for e in ev if e["event"] == "process_started"]
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
