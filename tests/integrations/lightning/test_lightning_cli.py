"""``configs/lightning/leto.yaml``: a ``LightningCLI`` config with ``strategy: leto`` fits the
example model through ``LightningCLI`` (``examples/lightning_cli.py``), one process, a few
steps: the trainer's strategy is ``LetoStrategy``, the config's values reach the trainer, model
and data module, the CSV logger holds every step's loss, and the retained memory is freed.

The fit runs in a forked child: ``LightningCLI`` leaves state in the process it fits in (threads
among it), and later tests of the suite fork children of the pytest process that would inherit
it (a child forked after it hung)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("jsonargparse", reason='LightningCLI needs jsonargparse: pip install "leto-lightning[lightning]"')

from leto_lightning.examples.lightning_cli import main
from leto_lightning.integrations.lightning import LetoStrategy
from leto_lightning.testing.crash import run_in_child

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "lightning" / "leto.yaml"


def test_lightning_cli_fits_with_the_leto_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    def fit() -> tuple:
        cli = main(["fit", "--config", str(CONFIG), "--trainer.devices", "1", "--trainer.max_steps", "3",
                    "--trainer.val_check_interval", "2", "--data.ranks", "1"])
        trainer = cli.trainer
        return (isinstance(trainer.strategy, LetoStrategy), trainer.global_step, cli.model.hparams.total_steps,
                cli.datamodule.batch_size)

    result = run_in_child(fit, timeout=240.0)
    assert result.exit_code == 0 and result.value is not None, result
    is_leto, global_step, total_steps, batch_size = result.value
    assert is_leto and global_step == 3
    assert total_steps == 40 and batch_size == 8
    rows = list(csv.DictReader(open(tmp_path / "lightning_cli_out" / "csv" / "version_0" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("train_loss")] == [0, 1, 2]
    assert (tmp_path / "lightning_cli_out" / "csv" / "version_0" / "config.yaml").exists()
