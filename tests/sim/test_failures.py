"""Failure models: durations, Poisson sampling, per-GPU scaling, traces, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from leto_lightning.sim.failures import LLAMA3_GPU_MTTF_S, FailureModel, load_trace, parse_duration


@pytest.mark.parametrize("text, seconds", [("10m", 600), ("600s", 600), ("1.5h", 5400),
                                           ("2d", 172800), ("10", 600), (10, 600),
                                           ("30 min", 1800)])
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-5m", "ten minutes", "5 fortnights", "0s", ""])
def test_parse_duration_names_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="--mttf="):
        parse_duration(text)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_hof_ratio_outside_unit_interval(ratio: float) -> None:
    with pytest.raises(ValueError, match="hof_ratio="):
        FailureModel(600.0, ratio)


def test_negative_mttf() -> None:
    with pytest.raises(ValueError, match="mttf=-1"):
        FailureModel(-1.0)


def test_sampling_is_seeded_and_poisson() -> None:
    fm = FailureModel(600.0, 0.3)
    a = fm.sample(4, 30 * 86400, np.random.default_rng(7))
    b = fm.sample(4, 30 * 86400, np.random.default_rng(7))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    finite = np.isfinite(a[0])
    counts = finite.sum(axis=1)
    assert abs(counts.mean() - 4320) < 4 * np.sqrt(4320)
    assert a[1][finite].mean() == pytest.approx(0.3, abs=0.03)
    for row in a[0]:
        assert np.all(np.diff(row[np.isfinite(row)]) > 0)


def test_per_gpu_rate_scales_with_cluster_size() -> None:
    fm = FailureModel.per_gpu(LLAMA3_GPU_MTTF_S, 16384)
    assert fm.mttf_s / 3600 == pytest.approx(54 * 24 / 419)      # Llama 3: one every ~3.1 h
    assert FailureModel.per_gpu(LLAMA3_GPU_MTTF_S, 131072).mttf_s / 60 == pytest.approx(23.2,
                                                                                         abs=0.1)


def test_trace_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("# a trace\ntime,kind\n100,hof\n50,non-hof\n400,HOF\n")
    trace = load_trace(path)
    assert list(trace.times_s) == [50, 100, 400]
    assert list(trace.is_hof) == [False, True, True]
    fm = FailureModel.from_trace(trace)
    assert fm.hof_ratio == pytest.approx(2 / 3)
    times, hof = fm.sample(2, 300.0, np.random.default_rng(0))
    assert times.shape == (2, 2) and list(hof[0]) == [False, True]


@pytest.mark.parametrize("body, fragment", [("10,maybe\n", "kind='maybe'"),
                                            ("abc,hof\n", "time='abc'"),
                                            ("10\n", "needs two fields")])
def test_trace_errors_name_file_line_and_value(tmp_path: Path, body: str, fragment: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert "bad.csv:1" in str(err.value) and fragment in str(err.value)


def test_missing_trace_file() -> None:
    with pytest.raises(ValueError, match="--trace='nope.csv'"):
        load_trace("nope.csv")
