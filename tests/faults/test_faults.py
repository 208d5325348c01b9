"""The LETO_FAULTS injector really ends the process, where and as often as the fault says.

Each case runs in a forked child (``testing.crash.run_in_child``) with a ``FaultInjector`` as the
injection-point hook; the child walks the points of two iterations and returns what it passed.
The launched-job tests run the same injector inside ``leto launch``; here each rule is one case.
"""

from __future__ import annotations

import faulthandler
import signal

import pytest

from leto_lightning.faults import FaultInjector, hof_faults, point, set_hook
from leto_lightning.testing.crash import run_in_child


class _Trainer:
    """A FaultTarget whose record of fired faults lives in the process (the runtime keeps it in the
    job's store)."""

    def __init__(self, rank: int = 0, shadow: bool = False, fired: tuple = (), ready: str = "0-0") -> None:
        self.rank, self.shadow, self.fired_ids, self.ready = rank, shadow, set(fired), ready
        self.iteration, self.generation = 0, 0

    def striking(self) -> bool:
        return not self.shadow

    def position(self) -> tuple[int, int]:
        return self.iteration, self.generation

    def fired(self, fault_id: object) -> bool:
        return fault_id in self.fired_ids

    def mark_fired(self, fault_id: object) -> None:
        self.fired_ids.add(fault_id)

    def ready_shadow_set(self) -> str:
        return self.ready


def _walk(faults: list[dict], trainer: _Trainer) -> list[str]:
    """Install the injector, pass compute.begin and chunk.math_done x2 of iterations 0 and 1."""
    faulthandler.disable()  # pytest's handler would print a traceback for the SIGBUS case
    passed = []
    FaultInjector(faults, trainer).install()
    try:
        for it in (0, 1):
            trainer.iteration = it
            for name in ("compute.begin", "chunk.math_done", "chunk.math_done"):
                point(name)
                passed.append(f"{it}:{name}")
    finally:
        set_hook(None)
    return passed


KILL = {"id": 0, "rank": 0, "point": "chunk.math_done", "iteration": 1}


@pytest.mark.parametrize(("fault", "trainer", "ends"), [
    (KILL, _Trainer(), ("signal", signal.SIGKILL)),
    ({**KILL, "occurrence": 2}, _Trainer(), ("signal", signal.SIGKILL)),
    ({**KILL, "occurrence": 3}, _Trainer(), None),  # the point is reached twice in iteration 1
    ({**KILL, "signal": int(signal.SIGBUS)}, _Trainer(), ("signal", signal.SIGBUS)),
    ({**KILL, "action": "exit", "code": 7}, _Trainer(), ("exit", 7)),
    ({**KILL, "wait_shadows": "0-0"}, _Trainer(), ("signal", signal.SIGKILL)),
    (KILL, _Trainer(rank=1), None),  # another rank's fault
    (KILL, _Trainer(shadow=True), None),  # a waiting shadow is never struck
    (KILL, _Trainer(fired=(0,)), None),  # fired once already (an earlier generation)
    ({**KILL, "generation": 1}, _Trainer(), None),
])
def test_fault_fires_where_it_says(fault, trainer, ends) -> None:
    result = run_in_child(lambda: _walk([fault], trainer), timeout=60)
    if ends is None:
        assert result.exit_code == 0 and len(result.value) == 6, result
    elif ends[0] == "signal":
        assert result.signal == ends[1] and result.value is None, result
    else:
        assert result.exit_code == ends[1] and result.signal is None, result


def test_hof_schedule_is_seeded_and_never_at_iteration_zero() -> None:
    plan = hof_faults(5, "random", 30, 2, seed=3)
    assert plan == hof_faults(5, "random", 30, 2, seed=3)
    assert [f["iteration"] for f in plan] == [5, 10, 15, 20, 25] and [f["id"] for f in plan] == list(range(5))
    assert {f["point"] for f in hof_faults(1, "compute", 30, 2, seed=0)} == {"compute.begin"}
