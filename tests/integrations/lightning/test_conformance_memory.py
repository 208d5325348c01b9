"""No retained memory outlives a fit nobody can resume (single process, no ``leto launch``).

A fit that completes, raises in ``training_step`` or is stopped by ``KeyboardInterrupt``
leaves no ``/dev/shm/leto-*`` segment and no mapping of one in the process; 20 fits in one
process (a sweep) neither. The module and the optimizer stay usable after the fit (their
values were copied out of retained memory before it was freed). A process that dies keeps its
store for a resume: ``test_lightning_strategy.test_existing_store_is_not_overwritten``.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from pl_job import TinyModule, dataloaders

from leto_lightning.integrations.lightning import LetoStrategy
from leto_lightning.retained.shm import SEGMENT_PREFIX, SHM_DIR, list_segments
from leto_lightning.testing.crash import run_in_child


def _trainer(**kwargs: Any) -> pl.Trainer:
    args = dict(strategy=LetoStrategy(), accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=1,
                num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False)
    return pl.Trainer(**{**args, **kwargs})


def _mapped_leto_segments() -> list[str]:
    """Leto segments this process still maps (freed memory must not stay mapped either)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        # the path, with " (deleted)" when unlinked but still mapped
        return sorted({line.split(maxsplit=5)[-1].strip() for line in f if f"{SHM_DIR}/{SEGMENT_PREFIX}" in line})


def _left(trainer: pl.Trainer) -> list[str]:
    return list_segments(f"{SEGMENT_PREFIX}{trainer.strategy.job_id}-")


class _Raises(TinyModule):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 4:  # after four committed steps
            raise self.error("stop")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_fit_that_raises_frees_its_retained_memory(error: type[BaseException]) -> None:
    def child() -> dict:
        inherited = _mapped_leto_segments()  # what the forking test process maps is not this fit's
        trainer, model = _trainer(), _Raises(error)
        # Lightning turns KeyboardInterrupt into a graceful shutdown and sys.exit(1)
        with pytest.raises(SystemExit if error is KeyboardInterrupt else error):
            trainer.fit(model, *dataloaders())
        return {"job": trainer.strategy.job_id, "step": trainer.global_step, "left": _left(trainer),
                "mapped": sorted(set(_mapped_leto_segments()) - set(inherited)),
                "usable": bool(torch.isfinite(model.head.weight.sum()))}

    out = run_in_child(child).value
    assert out["job"] and out["step"] == 4
    assert out["left"] == [] and out["mapped"] == [] and out["usable"]


def test_a_completed_fit_and_a_sweep_of_20_leave_nothing() -> None:
    def child() -> dict:
        inherited = _mapped_leto_segments()  # what the forking test process maps is not these fits'
        train, val = dataloaders(n=8)
        jobs, left = [], []
        for seed in range(20):
            trainer, model = _trainer(max_steps=1, limit_val_batches=0), TinyModule(seed=seed)
            trainer.fit(model, train, val)
            jobs.append(trainer.strategy.job_id)
            left += _left(trainer)
            # still usable after the fit: the evaluation reads the weights copied out of retained memory
            trainer.validate(model, val, verbose=False)
            model.head.weight.sum().item()
            trainer.optimizers[0].state_dict()
        return {"jobs": len(set(jobs)), "left": left, "mapped": sorted(set(_mapped_leto_segments()) - set(inherited))}

    out = run_in_child(child, timeout=300).value
    assert out["jobs"] == 20 and out["left"] == [] and out["mapped"] == []
