"""``configs/lightning/leto.yaml``: a ``LightningCLI`` config with ``strategy: leto`` fits the
example model through ``LightningCLI`` (``examples/lightning_cli.py``), one process, a few
steps: the trainer's strategy is ``LetoStrategy``, the config's values reach the trainer, model
and data module, the CSV logger holds every step's loss, and the retained memory is freed."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("jsonargparse", reason='LightningCLI needs jsonargparse: pip install "leto-lightning[lightning]"')

from leto_lightning.examples.lightning_cli import main
from leto_lightning.integrations.lightning import LetoStrategy

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "lightning" / "leto.yaml"


def test_lightning_cli_fits_with_the_leto_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", "--config", str(CONFIG), "--trainer.devices", "1", "--trainer.max_steps", "3",
                "--trainer.val_check_interval", "2", "--data.ranks", "1"])
    trainer = cli.trainer
    assert isinstance(trainer.strategy, LetoStrategy) and trainer.global_step == 3
    assert cli.model.hparams.total_steps == 40 and cli.datamodule.batch_size == 8
    rows = list(csv.DictReader(open(tmp_path / "lightning_cli_out" / "csv" / "version_0" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("train_loss")] == [0, 1, 2]
    assert (tmp_path / "lightning_cli_out" / "csv" / "version_0" / "config.yaml").exists()
