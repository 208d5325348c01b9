"""The README's first command works and tells the truth."""

from leto_lightning.cli import main


def test_leto_demo_runs_and_reports_bit_identical(capsys):
    assert main(["demo", "--core"]) == 0
    out = capsys.readouterr().out
    assert out.count("yes") >= 3 and "NO" not in out and "refused" in out
