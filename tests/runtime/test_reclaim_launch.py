"""Shadow memory reclaim end to end: ``leto launch --memory-budget`` with a trainer whose memory grows.

Figures of examples/growing_memory.py on CPU (one rank): a process with torch and gloo holds
~210 MiB private memory; ``--warm-mib 768`` more once built (the active trainer, an L3 shadow);
from iteration 3 on the active trainer grows by 32 MiB per iteration to 768 MiB more. Budget
2500 MiB, low watermark 15%:
  before the growth, L3 shadow: ~1960 MiB used, free ~540 > 375 -> stays at L3
  grown, L3 shadow:             ~2730 MiB -> over the budget (what policy off shows)
  grown, L2 shadow:             ~1960 MiB, free ~540 -> stays at L2 (promotion to L3 would not fit)
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.runtime import harness

SCRIPT = os.path.join(os.path.dirname(harness.PLAIN_DDP), "growing_memory.py")
ITERATIONS, FAULT_AT = 34, 30
SCRIPT_ARGS = ["--iterations", str(ITERATIONS), "--warm-mib", "768", "--grow-at", "3", "--grow-mib", "768",
               "--grow-step-mib", "32", "--sleep", "0.1"]
BUDGET = ["--memory-budget", "2500MiB", "--reclaim-low", "15%", "--reclaim-dwell", "1", "--heartbeat-timeout", "60"]


def _launch(run_dir, extra, faults=()):
    args = harness.launch_args(run_dir, 0, faults=faults, extra=[*BUDGET, *extra], nproc=1)
    args[args.index(harness.PLAIN_DDP):] = [SCRIPT, *SCRIPT_ARGS]  # the growing example instead of plain_ddp
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        return harness.finish(proc, run_dir, timeout=240)
    finally:
        harness.stop(proc)


def test_a_growing_trainer_demotes_the_shadow_in_time_and_recovers_from_l2_bit_identical(tmp_path) -> None:
    # policy off: the same set-up goes over the budget -- the probe says so, the job still finishes
    off = _launch(tmp_path / "off", ["--memory-reclaim", "off"])
    assert off.returncode == 0, off.output[-3000:]
    over = off.of("memory_over_budget")
    assert len(over) >= 1 and over[0]["level"] == 3 and not over[0]["reclaim"], over
    assert over[0]["used_mib"] > over[0]["limit_mib"] and over[0]["shadow_mib"] > 700, over[0]
    assert "memory over the limit" in off.output and not off.of("shadow_level_changed")

    # policy on: demoted before the budget is exceeded; a HOF once the demoted (L2) set is ready
    fault = {"id": 0, "rank": 0, "point": "compute.begin", "iteration": FAULT_AT, "wait_shadows": "0-1"}
    on = _launch(tmp_path / "on", [], faults=[fault])
    assert on.returncode == 0, on.output[-3000:]
    changes = on.of("shadow_level_changed")
    assert [(c["old"], c["new"]) for c in changes] == [(3, 2)], changes
    assert changes[0]["free_mib"] < 0.15 * 2500 and changes[0]["source"] == "budget" and changes[0]["shadow_mib"] > 700
    assert not on.of("memory_over_budget"), on.of("memory_over_budget")  # in time
    started = [e for e in on.of("shadow_level") if e["reason"] == "started"]
    assert [e["level"] for e in started][:2] == [3, 2] and all(e["level"] == 2 for e in started[1:])
    finished = on.of("recovery_finished")
    assert len(finished) == 1 and finished[0]["promoted"] == "shadow" and finished[0]["shadow_level"] == 2, finished
    assert on.of("failure_detected")[0]["iteration"] == FAULT_AT
    with open(on.run_dir / "memory_rank0.jsonl") as log:
        gens = {json.loads(line)["gen"] for line in log}
    assert gens == {0, 1}  # trained before and after the recovery
    assert harness.same_state(on.final(0), off.final(0)) == []  # bit-identical to the run without failures
