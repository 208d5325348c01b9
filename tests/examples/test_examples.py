"""The core examples the README's "Using the core" points to run as written (one forked child
each: no fresh interpreter) and end bit-identical, leaving no retained memory behind."""

from __future__ import annotations

import os
import runpy

import pytest

from leto_lightning.testing.crash import run_in_child

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.mark.parametrize("name", ["core_single_rank.py", "core_multi_rank.py"])
def test_core_example_runs(name):
    path = os.path.join(EXAMPLES, name)
    result = run_in_child(lambda: runpy.run_path(path, run_name="__main__") and None, timeout=120)
    assert result.exit_code == 0
