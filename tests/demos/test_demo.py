"""The README's first command works and tells the truth."""

from leto_lightning.cli import main


def test_leto_demo_runs_and_reports_bit_identical(capsys):
    assert main(["demo", "--core"]) == 0
    out = capsys.readouterr().out
    assert out.count("yes") >= 3 and "NO" not in out and "refused" in out


def test_leto_demo_end_to_end(tmp_path, capsys):
    """The README's first command: Lightning on 2 ranks, a mid-update HOF, bit-identical."""
    assert main(["demo", "--steps", "14", "--hof-every", "7", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bit-identical to the fault-free run: yes" in out and "ETTR" in out
    assert (tmp_path / "loss.png").exists() and list((tmp_path / "faulty" / "wandb").glob("offline-run-*"))
