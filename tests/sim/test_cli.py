"""``leto simulate``: output, JSON, traces, validation, bad input naming the value."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from leto_lightning.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["simulate", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--recipe", "--mttf", "--hof-ratio", "--systems", "--json", "--trace",
                 "--gpu-mttf", "--gpus", "--comm-init", "--validate"):
        assert flag in text


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--recipe", "kimi_moe", "--mttf", "10m", "--runs", "2",
                        "--days", "3")
    assert code == 0
    for name in ("leto", "gemini+", "gemini", "moevement", "checkpoint", "ETTR"):
        assert name in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--recipe", "olmoe", "--systems", "leto,gemini+", "--json",
                        "--hof-ratio", "0.5", "--interval", "gemini+=7", "--no-monte-carlo")
    assert code == 0
    data = json.loads(out)
    systems = {s["system"]: s for s in data["systems"]}
    assert set(systems) == {"leto", "gemini+"}
    assert systems["gemini+"]["param"] == 7 and not systems["gemini+"]["tuned"]
    assert systems["leto"]["tuned"] and systems["leto"]["monte_carlo"] is None
    assert data["failures"]["hof_ratio"] == 0.5
    assert systems["leto"]["analytic"]["ettr"] > systems["gemini+"]["analytic"]["ettr"]


def test_largest_configuration_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """30 simulated days of DeepSeek-V4 on 131,072 GPUs (timing goes to
    benchmarks/sim_speed.py; here it is only printed)."""
    start = time.perf_counter()
    code, out, _ = _run(capsys, "--recipe", "deepseek_v4", "--mttf", "10m", "--json",
                        "--comm-init", "scalable")
    elapsed = time.perf_counter() - start
    data = json.loads(out)
    assert code == 0 and data["workload"]["n_gpus"] == 131072
    leto = next(s for s in data["systems"] if s["system"] == "leto")
    assert leto["monte_carlo"]["failures_per_run"] > 4000
    print(f"deepseek_v4 / 131,072 GPUs / 30 days, 5 systems x 8 runs: {elapsed:.2f} s")


def test_trace_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time,kind\n" + "".join(f"{600 * k},{'hof' if k % 2 else 'non-hof'}\n"
                                             for k in range(1, 200)))
    code, out, _ = _run(capsys, "--trace", str(trace), "--systems", "leto,gemini+", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["failures"]["trace"] == str(trace)
    assert data["settings"]["horizon_s"] == pytest.approx(199 * 600)


def test_per_gpu_failure_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--recipe", "deepseek_v3", "--gpu-mttf", "llama3", "--json",
                        "--no-monte-carlo", "--systems", "leto")
    assert code == 0
    assert json.loads(out)["failures"]["mttf_s"] / 60 == pytest.approx(185.6, abs=1)


def test_validate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--validate")
    assert code == 0 and "olmoe" in out and "gemini+ (I=11)" in out


@pytest.mark.parametrize("argv, fragment", [
    (("--hof-ratio", "1.5"), "--hof-ratio=1.5"),
    (("--hof-ratio", "-0.2"), "--hof-ratio=-0.2"),
    (("--recipe", "nope"), "--recipe='nope'"),
    (("--gpus", "100", "--dp", "2", "--tp", "2", "--pp", "2"), "--gpus=100"),
    (("--recipe", "deepseek_v4", "--gpus", "1000"), "--gpus=1000"),
    (("--tp", "-4"), "--tp=-4"),
    (("--mttf=-5m",), "--mttf='-5m'"),
    (("--mttf", "5 fortnights"), "--mttf='5 fortnights'"),
    (("--hw", "bogus=1"), "hardware override='bogus'"),
    (("--hw", "net_gbps=fast"), "hardware.net_gbps='fast'"),
    (("--interval", "gemini=0"), "--interval gemini=0"),
    (("--interval", "gemini"), "--interval='gemini'"),
    (("--systems", "leto,bogus"), "--systems='bogus'"),
    (("--runs", "0"), "runs=0"),
    (("--trace", "missing.csv"), "--trace='missing.csv'"),
    (("--iteration-time", "-1"), "--iteration-time=-1"),
])
def test_bad_input_exits_2_naming_the_value(capsys: pytest.CaptureFixture[str], argv,
                                            fragment: str) -> None:  # type: ignore[no-untyped-def]
    code, out, err = _run(capsys, *argv, "--no-monte-carlo")
    assert code == 2 and out == ""
    assert fragment in err, err
