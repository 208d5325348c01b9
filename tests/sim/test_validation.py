"""Validation against measurements (Table 6 analog, ETTR vs fault injection)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leto_lightning.sim.validation import MEASURED_PATH, ettr_rows, iteration_rows


def test_shipped_measurements_are_labelled_and_used() -> None:
    data = json.loads(MEASURED_PATH.read_text())
    assert all("not measured by this project" in e["source"] for e in data["iteration_time"])
    rows = {(r.recipe, r.size): r for r in iteration_rows()}
    olmoe, qwen = rows[("olmoe", "full")], rows[("qwen", "full")]
    assert olmoe.error is not None and abs(olmoe.error) < 0.5
    assert qwen.error is None and qwen.implied_batch


def test_ettr_against_the_papers_fault_injection() -> None:
    for row in ettr_rows():
        assert abs(row.error_points) < 3.0


def test_a_cpu_measurement_file(tmp_path: Path) -> None:
    from leto_lightning.sim.workload import recipes_dir
    if not (recipes_dir() / "olmoe.yaml").is_file():
        pytest.skip("recipes not present")
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"iteration_time": [
        {"recipe": "olmoe", "size": "tiny", "hardware": "cpu", "measured_s": 0.2,
         "global_batch": 16, "source": "test"}]}))
    (row,) = iteration_rows(path)
    assert row.predicted_s and row.predicted_s > 0 and row.error is not None


def test_bad_measurement_file(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        iteration_rows(path)


def test_tiny_cpu_measurements_are_read_when_present(tmp_path: Path) -> None:
    from leto_lightning.sim.workload import recipes_dir
    if not (recipes_dir() / "qwen.yaml").is_file():
        pytest.skip("recipes not present")
    (tmp_path / "measured.json").write_text('{"iteration_time": []}')
    (tmp_path / "measured_tiny.json").write_text('{"qwen": 0.08}')
    (row,) = iteration_rows(tmp_path / "measured.json")
    assert (row.recipe, row.size, row.hardware, row.global_batch) == ("qwen", "tiny", "cpu", 16)
    assert row.error is not None and "one rank" in row.source
