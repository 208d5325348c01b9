"""The per-step shortcuts of payload capture give exactly what the slow ways give:
``FrozenPayload`` (pickled once, small CPU tensors as raw bytes) reads back equal values of the
same types through the progress record, and ``loop_state.loop_state_dict`` equals Lightning's
``fit_loop.state_dict()`` at every batch end and validation end of a fit with accumulation,
mid-epoch validation and an LR schedule."""

from __future__ import annotations

import pickle

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from leto_lightning.integrations.lightning import loop_state
from leto_lightning.integrations.lightning.frozen import FrozenPayload
from leto_lightning.retained.record import ProgressEntry, ProgressRecord, RecordStatus


def _payload() -> dict:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "rng": torch.get_rng_state(), "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "scalar": torch.tensor(7), "bool": torch.tensor([True, False]), "empty": torch.zeros(0, 3),
        "transposed": base.t(), "param": torch.nn.Parameter(torch.ones(2)), "alias": base,
        "same": base, "nested": [{"x": (1, 2.5, "s", None)}], "complex": torch.tensor([1 + 2j]).conj(),
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_frozen_payload_reads_back_equal_through_the_record() -> None:
    payload = _payload()
    frozen = FrozenPayload(payload)
    record = ProgressRecord(torch.zeros(1 << 16, dtype=torch.uint8))
    record.write(ProgressEntry(RecordStatus.COMMITTED, 3, frozen))
    record.write(ProgressEntry(RecordStatus.COMMITTED, 4, frozen))  # written twice, pickled once
    got = record.read().progress
    assert got.iteration == 4 and not isinstance(got.payload, FrozenPayload)
    assert _equal(got.payload, payload)
    assert got.payload["alias"] is got.payload["same"]  # one object stays one object
    assert _equal(pickle.loads(pickle.dumps(payload)), frozen.thaw())
    payload["bf16"].add_(1)  # frozen when captured: later changes do not reach it
    assert not _equal(frozen.thaw()["bf16"], payload["bf16"])


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}


class _Compare(pl.Callback):
    def __init__(self) -> None:
        self.checked, self.diffs = 0, []

    def _check(self, trainer: pl.Trainer, where: str) -> None:
        fast, real = loop_state._fast(trainer.fit_loop), trainer.fit_loop.state_dict()
        if fast != real:
            self.diffs.append(where)
        self.checked += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._check(trainer, f"batch end {trainer.global_step}")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._check(trainer, f"validation end {trainer.global_step}")


def test_fast_loop_state_equals_lightnings_throughout_a_fit() -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
    cmp = _Compare()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, val_check_interval=0.5,
                         limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cmp])
    trainer.fit(_Tiny(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
    assert cmp.diffs == [] and cmp.checked >= 24
    assert loop_state.loop_state_dict(trainer.fit_loop) == trainer.fit_loop.state_dict()  # checked, then fast
    assert loop_state._CHECKED[trainer.fit_loop] is True


def test_non_parameter_state_shortcut_sees_buffers_added_later() -> None:
    """A module tree with no buffers is recognised once and then skipped; a submodule added
    later (with running statistics) is captured from then on, as ``state_dict`` would give."""
    from leto_lightning.integrations.lightning.resume import non_parameter_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    assert non_parameter_state(model) == {} and non_parameter_state(model) == {}
    model.append(torch.nn.BatchNorm1d(3))
    model(torch.randn(4, 3))  # running statistics move
    got = non_parameter_state(model)
    stats = ("running_mean", "running_var", "num_batches_tracked")
    want = {k: v for k, v in model.state_dict().items() if k.split(".")[-1] in stats}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    model(torch.randn(4, 3))
    assert not torch.equal(non_parameter_state(model)["2.running_mean"], got["2.running_mean"])
