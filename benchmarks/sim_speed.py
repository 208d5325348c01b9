"""How fast is the simulator? 30 simulated days of DeepSeek-V4 on 131,072 GPUs, MTTF 10 min.

    python benchmarks/sim_speed.py

Pins numpy/BLAS to one thread so the numbers are one core's. Prints wall and CPU seconds for:
the whole ``leto simulate`` pipeline (iteration model, tuning, analytic and Monte Carlo for five
systems, 8 runs each); one system with one run; and the analytic model alone.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import time  # noqa: E402

from leto_lightning.sim.ettr import analytic, monte_carlo  # noqa: E402
from leto_lightning.sim.failures import FailureModel  # noqa: E402
from leto_lightning.sim.hardware import get_hardware  # noqa: E402
from leto_lightning.sim.report import SimSettings, make_context, simulate  # noqa: E402
from leto_lightning.sim.startup import StartupModel  # noqa: E402
from leto_lightning.sim.systems import SYSTEMS  # noqa: E402
from leto_lightning.sim.workload import BUILTIN_WORKLOADS  # noqa: E402

DAYS = 30.0


def _timed(label: str, fn):  # type: ignore[no-untyped-def]
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    print(f"{label:<62s} {time.perf_counter() - wall:7.3f} s wall {time.process_time() - cpu:7.3f} s CPU")
    return out


def main() -> None:
    wl, hw = BUILTIN_WORKLOADS["deepseek_v4"], get_hardware("a100")
    failures = FailureModel(600.0, 1.0)
    startup = StartupModel(comm_init="scalable")
    print(f"{wl.describe()}; {DAYS:g} days, MTTF 10 min (~{DAYS * 86400 / 600:.0f} failures/run)")
    report = _timed("leto simulate: 5 systems, tuned, analytic + 8 MC runs each",
                    lambda: simulate(wl, hw, failures, settings=SimSettings(DAYS * 86400, 8),
                                     startup=startup))
    _timed("leto simulate: 5 systems, tuned, analytic + 1 MC run each",
           lambda: simulate(wl, hw, failures, settings=SimSettings(DAYS * 86400, 1),
                            startup=startup))
    ctx = make_context(wl, hw, startup=startup)
    schedule = SYSTEMS["leto"].schedule(ctx, 10000)
    mc = _timed("Monte Carlo only: leto, 1 run", lambda: monte_carlo(schedule, failures,
                                                                       DAYS * 86400, 1, 0))
    _timed("Monte Carlo only: leto, 64 runs (vectorized across runs)",
           lambda: monte_carlo(schedule, failures, DAYS * 86400, 64, 0))
    _timed("analytic only: leto, 1000 evaluations",
           lambda: [analytic(schedule, 600.0, 1.0) for _ in range(1000)])
    leto = report.result("leto")
    print(f"leto: {mc.failures:.0f} failures in the 1-run simulation; ETTR analytic "
          f"{leto.analytic.ettr:.4f}, Monte Carlo {leto.mc.ettr:.4f} ± {leto.mc.stderr:.4f}")


if __name__ == "__main__":
    main()
