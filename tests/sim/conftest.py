"""Shared fixtures for the simulator tests."""

from __future__ import annotations

import pytest

from leto_lightning.sim.hardware import get_hardware
from leto_lightning.sim.report import make_context
from leto_lightning.sim.systems import SystemContext
from leto_lightning.sim.workload import BUILTIN_WORKLOADS

KIMI_PAPER_ITERATION_S = 9.097   # paper Table 6, measured


@pytest.fixture(scope="session")
def kimi_ctx() -> SystemContext:
    """Kimi-MoE on 64 A100s at the paper's measured iteration time (Table 3's setting)."""
    return make_context(BUILTIN_WORKLOADS["kimi_moe"], get_hardware("a100"),
                        iteration_s=KIMI_PAPER_ITERATION_S)
