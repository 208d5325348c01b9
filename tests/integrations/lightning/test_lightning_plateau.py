"""``ReduceLROnPlateau`` under LetoStrategy: step- and epoch-interval, on a validation metric and
on a training metric, across SIGKILLs wherever its step or its metric could get lost -- mid
update, between steps, inside a validation, right after one, at an epoch's end. Every run ends
bit-identical (weights, optimizer state, LR, RNG) to an uninterrupted single-device run without
Leto, with the same validation rows.

The schedulers are set to reduce at every step they take (``mode="max"`` on a loss, patience 0),
so one step missed or taken twice changes the LR, and with it the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from pl_job import RunConfig, TinyModule, differences, fit
from test_lightning_resume import _leto, _val_rows, _validating, crash_then_resume

from leto_lightning.testing.crash import KillPoint, run_in_child

CHUNKS = 7  # chunk transactions per step at page_bytes=512


def _plateau(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.8, patience=0, threshold=0.0)


class EpochPlateau(TinyModule):
    """Epoch interval on the validation loss (Lightning's usual setup)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _plateau(opt), "monitor": "val_loss",
                                                   "interval": "epoch"}}


class StepPlateaus(TinyModule):
    """Step interval: one on the validation loss (every 2 batches), one on the training loss."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2)
        return [opt], [{"scheduler": _plateau(opt), "monitor": "val_loss", "interval": "step", "frequency": 2,
                        "strict": False},  # no val_loss before the first validation: Lightning skips
                       {"scheduler": _plateau(opt), "monitor": "train_loss", "interval": "step", "frequency": 3}]


MODULES = {"epoch": EpochPlateau, "step": StepPlateaus}


def _cfg(kind: str, directory: str, strategy: Any, **kw: Any) -> RunConfig:
    return dataclasses.replace(_validating(directory, strategy, **kw), module=MODULES[kind])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[str, tuple[dict, str]] = {}

    def get(kind: str) -> tuple[dict, str]:
        if kind not in cache:
            directory = str(tmp_path_factory.mktemp(f"ref-{kind}"))
            cache[kind] = (run_in_child(lambda: fit(_cfg(kind, directory, "auto"))).value, directory)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind, kill_at", [
    ("epoch", KillPoint("chunk.math_done", 9 * CHUNKS + 3)),  # the epoch's last update
    ("epoch", KillPoint("lightning.validation", 3)),  # inside the epoch-end validation
    ("epoch", KillPoint("lightning.epoch_end", 1)),  # after it, in on_train_epoch_end
    ("epoch", KillPoint("prepare.begin", 14)),  # mid-epoch 1: the next epoch end comes after a restart
    ("step", KillPoint("prepare.begin", 7)),  # between steps: step 6's plateau steps (both) still owed
    ("step", KillPoint("prepare.begin", 6)),  # step 5's validation done, its plateau step (val_loss) owed
    ("step", KillPoint("chunk.math_done", 7 * CHUNKS + 2)),  # mid-update
    ("step", KillPoint("lightning.validation", 4)),  # inside a validation
])
def test_plateau_steps_survive_a_crash(kind: str, kill_at: KillPoint, reference, job: str, tmp_path) -> None:
    ref, ref_dir = reference(kind)
    run_dir = str(tmp_path / "run")
    got = crash_then_resume(lambda *a, **kw: _cfg(kind, *a, **kw), job, run_dir, kill_at)
    assert differences(got, ref) == []
    assert ref["lr"][0] <= 3e-2 * 0.8 ** 2  # the plateau schedulers did reduce, more than once
    assert _val_rows(run_dir) == _val_rows(ref_dir)


def test_without_faults_equal_to_lightning(reference, jobs, tmp_path) -> None:
    for kind in MODULES:
        ref, _ = reference(kind)
        job = jobs()
        got = run_in_child(lambda: fit(_cfg(kind, str(tmp_path / kind), _leto(job)))).value
        assert differences(got, ref) == [], kind
