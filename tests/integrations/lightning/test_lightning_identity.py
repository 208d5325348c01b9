"""Without faults, LetoStrategy trains bit-identically to Lightning's single-device strategy.

The job (pl_job.py) clips gradients, accumulates 2 batches per step, steps a warm-up LR
schedule per step and a decay per epoch, validates every epoch and uses dropout and
BatchNorm; weights, buffers, optimizer state, LR and the final RNG state are compared with
``torch.equal``.
"""

from __future__ import annotations

import pytest
from pl_job import RunConfig, differences, fit

from leto_lightning.integrations.lightning import LetoStrategy
from leto_lightning.testing.crash import run_in_child


def _leto(job: str) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, chunk_pages=1, data_pages=4, tier1_parity=1)


@pytest.mark.parametrize("optimizer, precision", [
    ("adamw", "32-true"),
    ("sgd", "32-true"),
    ("rmsprop", "32-true"),  # no chunk-wise math: one whole-state transaction per step
    ("adamw", "bf16-mixed"),
])
def test_bit_identical_to_single_device(optimizer: str, precision: str, job: str) -> None:
    cfg = dict(optimizer=optimizer, precision=precision)
    plain = run_in_child(lambda: fit(RunConfig(**cfg))).value

    def leto() -> tuple:
        out = fit(RunConfig(strategy=_leto(job), **cfg))
        rec = out["record"]  # as the fit ended: a completed fit frees its retained memory
        return out, rec.status, rec.iteration, rec.payload["kind"]

    got, status, iteration, kind = run_in_child(leto).value
    assert differences(got, plain) == []
    assert plain["global_step"] == 15
    # every optimizer step was a committed transaction; the last payload is the final validation's
    assert (status, iteration, kind) == ("committed", 14, "validation_end")
