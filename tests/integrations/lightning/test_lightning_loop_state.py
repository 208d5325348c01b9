"""The resume payload and the resumable loader, checked without crashing anything.

The transaction records its payload at *prepare*, before Lightning finishes the batch;
``finish_batch`` must turn it into exactly the state Lightning holds inside
``on_train_batch_end`` of that batch (the point Lightning's restart logic resumes from).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from pl_job import RunConfig, TinyModule, dataloaders, trainer_for
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from leto_lightning.integrations.lightning import LetoStrategy, ResumableDataLoader
from leto_lightning.integrations.lightning.fit_state import BatchPhase
from leto_lightning.integrations.lightning.resume import apply_param_groups, capture, finish_batch
from leto_lightning.testing.crash import run_in_child
from leto_lightning.updater.retained_optimizer import hyperparameters


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested payloads differ (tensors and arrays compared exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [path]
    if isinstance(a, np.ndarray):
        return [] if np.array_equal(a, b) else [path]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


class _Compare(pl.Callback):
    """At every batch end that followed an optimizer step: finish_batch(prepare) == capture here."""

    def __init__(self, strategy: LetoStrategy) -> None:
        self.strategy, self.prepared, self.checked, self.diffs = strategy, None, 0, []
        original = strategy.loop_state.payload_at_prepare

        def stash(trainer: pl.Trainer) -> dict:
            self.prepared = original(trainer)
            return self.prepared

        strategy.loop_state.payload_at_prepare = stash

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.strategy.fit_state.phase is not BatchPhase.STEPPED:
            return
        here = capture(trainer, "batch_end")
        opt = trainer.optimizers[0]
        saved = ([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs], hyperparameters(opt))
        finished = finish_batch(trainer, self.prepared)
        for config, state in zip(trainer.lr_scheduler_configs, saved[0]):  # leave the live run untouched
            config.scheduler.load_state_dict(state)
        apply_param_groups(opt, saved[1])
        self.diffs += [f"step {trainer.global_step}: {d}" for d in same(finished, here)]
        self.checked += 1


@pytest.mark.parametrize("accumulate, step_frequency, val_check", [(2, 2, 0.5), (1, 3, 1.0)])
def test_finished_prepare_payload_equals_batch_end_state(accumulate: int, step_frequency: int, val_check: float,
                                                         job: str) -> None:
    def child() -> tuple:
        strategy = LetoStrategy(job_id=job, page_bytes=512)
        cmp = _Compare(strategy)
        cfg = RunConfig(strategy=strategy, accumulate=accumulate, val_check_interval=val_check,
                        trainer_kwargs={"callbacks": [cmp]})
        model = TinyModule(step_frequency=step_frequency)
        trainer = trainer_for(cfg)
        train, val = dataloaders()
        trainer.fit(model, train, val)
        return cmp.checked, cmp.diffs, trainer.global_step

    checked, diffs, steps = run_in_child(child).value
    assert diffs == []
    assert checked == steps == 30 // accumulate


# -- the resumable loader --------------------------------------------------------------------
class _Counting(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


def _epoch(loader: ResumableDataLoader, epoch: int, take: int | None = None) -> list[list[int]]:
    """What Lightning does: iter(), then set_epoch, then next() and mark() per batch."""
    it = iter(loader)
    loader.sampler.set_epoch(epoch)
    out = []
    for i, batch in enumerate(it):
        loader.mark(i + 1, epoch_done=(i + 1 == len(loader)))
        out.append(batch.tolist())
        if take is not None and len(out) == take:
            break
    return out


def _make(sampler_kind: str, dataset: Dataset) -> ResumableDataLoader:
    if sampler_kind == "distributed":
        sampler = DistributedSampler(dataset, 1, 0, shuffle=True, seed=3)
    else:  # a RandomSampler with its own generator (no set_epoch: the generator advances)
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(5))
        sampler.set_epoch = lambda epoch: None
    return ResumableDataLoader(DataLoader(dataset, batch_size=3, sampler=sampler))


@pytest.mark.parametrize("sampler_kind", ["distributed", "generator"])
@pytest.mark.parametrize("epoch, take", [(0, 2), (1, 4), (1, 7)])  # 7 of 7: resumed at the epoch's end
def test_loader_resumes_where_training_stood(sampler_kind: str, epoch: int, take: int) -> None:
    full = _make(sampler_kind, _Counting(20))
    reference = [_epoch(full, e) for e in range(3)]
    run = _make(sampler_kind, _Counting(20))
    for e in range(epoch):
        _epoch(run, e)
    assert _epoch(run, epoch, take) == reference[epoch][:take]
    state = run.state_dict()

    dataset = _Counting(20)
    resumed = _make(sampler_kind, dataset)
    resumed.load_state_dict(state)
    if take < len(resumed):
        assert _epoch(resumed, epoch) == reference[epoch][take:]
        skipped = {i for b in reference[epoch][:take] for i in b}
        assert not skipped & set(dataset.loaded), "skipped batches must not be loaded"
    assert _epoch(resumed, epoch + 1) == reference[epoch + 1]


def test_loader_looks_like_its_dataloader() -> None:
    inner = DataLoader(_Counting(10), batch_size=4, shuffle=True)
    wrapped = ResumableDataLoader(inner)
    assert wrapped.sampler is inner.sampler and wrapped.batch_sampler is inner.batch_sampler
    assert len(wrapped) == 3 and wrapped.dataset is inner.dataset and wrapped.num_workers == 0
    assert wrapped.unreplayable_order()  # shuffle=True without a generator: order from the global RNG
    wrapped.worker_init_fn = print
    assert inner.worker_init_fn is print
    assert not ResumableDataLoader(DataLoader(_Counting(10), batch_size=4)).unreplayable_order()
