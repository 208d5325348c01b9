"""A training loader Lightning can resume mid-epoch: ``state_dict`` / ``load_state_dict``.

Why it exists: a plain ``DataLoader`` is not resumable -- Lightning warns and restarts the
epoch at batch 0, so a resumed job trains on the wrong batches. A loader with
``state_dict``/``load_state_dict`` is saved under ``fit_loop["combined_loader"]`` and restored
before Lightning calls ``iter()`` on it.

Measured constraints this follows (docs/lightning.md, notes/lightning-accelerate.md):

- Lightning calls ``iter()`` *before* ``sampler.set_epoch``: skipping must happen lazily, at
  the first ``next()``, when the sampler's order for the epoch is known.
- Lightning prefetches one batch, so a counter inside the loader is one ahead of training:
  the position is what the strategy saw (``mark``, called at every batch start), never how many
  batches the loader produced.
- A checkpoint saved inside a batch Lightning has not processed (an exception or a signal in
  the middle of it: ``OnExceptionCheckpoint``, a save after the failed ``fit()``) makes
  Lightning redo that batch, so the position saved then is the batches *processed*
  (``processed``, the loop's count); a save whose batch is finished on resume (Leto's prepare
  payload, ``resume.finish_batch``) says None there and keeps the batch.
- The wrapper must look like the loader (``.sampler``, ``.batch_sampler``, ``len``): Lightning
  sets the sampler's epoch through them.

Random state the order depends on is recorded too: the generators of the loader and its
sampler (their state at the start of the epoch being resumed). An unseeded ``RandomSampler``
draws its seed from the global RNG and cannot be replayed; ``LetoStrategy`` warns about it
(with ``use_distributed_sampler=True``, Lightning's default, the sampler is a seeded
``DistributedSampler`` and the question does not arise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ...errors import UsageError
from ...retained.torch_internals import skip_sampled_indices


class ResumableDataLoader:
    """Wraps a ``DataLoader``; Lightning sees a stateful loader with the same samplers."""

    def __init__(self, loader: DataLoader, processed: Callable[[], int | None] | None = None) -> None:
        self.loader = loader
        self._processed = processed  # batches of the epoch Lightning has processed (None: count the current one)
        self.restored = False  # load_state_dict put a saved position back (a resume from a Leto-written state)
        self._consumed = 0  # batches of the current epoch training has taken (incl. the current one)
        self._epoch_done = False  # the current batch is the epoch's last
        self._skip = 0  # batches the next iterator skips (set by load_state_dict)
        self._lazy = False  # create the inner iterator at the first next() (resume at an epoch's end)
        self._epoch_start_states: list[torch.Tensor] = []

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``torch.save(trainer)``, ``copy.deepcopy``) holds no link to the live loop."""
        return dict(self.__dict__, _processed=None)

    # -- what Lightning and user code read -------------------------------------------------
    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def worker_init_fn(self) -> Any:
        return self.loader.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Any) -> None:  # Lightning's seed_everything(workers=True) sets it
        self.loader.worker_init_fn = fn

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    # -- position ------------------------------------------------------------------------
    def mark(self, consumed: int, epoch_done: bool) -> None:
        """Training is on the ``consumed``-th batch of the epoch (1-based); ``epoch_done``: it is
        the last. A state captured from now on resumes *after* this batch."""
        self._consumed, self._epoch_done = consumed, epoch_done

    def state_dict(self) -> dict:
        consumed, epoch_done = self._consumed, self._epoch_done
        processed = self._processed() if self._processed is not None else None
        if processed is not None and processed < consumed:  # saved inside a batch Lightning will redo
            consumed, epoch_done = processed, False
        if epoch_done:  # resume at the next epoch: generators as they are now
            return {"consumed": consumed, "epoch_done": True, "generators": self._generator_states()}
        return {"consumed": consumed, "epoch_done": False,
                "generators": [s.clone() for s in self._epoch_start_states]}

    def load_state_dict(self, state: dict) -> None:
        self.restored = True
        self._skip = 0 if state["epoch_done"] else int(state["consumed"])
        self._lazy = bool(state["epoch_done"])
        gens = self._generators()
        if len(gens) != len(state["generators"]):
            raise UsageError(f"the loader has {len(gens)} generators, the resume state {len(state['generators'])}: "
                             "build the training DataLoader the same way as the run being resumed")
        for gen, value in zip(gens, state["generators"]):
            gen.set_state(value)

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        self._epoch_start_states = self._generator_states()
        skip, lazy = self._skip, self._lazy
        self._skip, self._lazy = 0, False
        self._consumed, self._epoch_done = skip, False
        if lazy:
            # Resuming after an epoch's last batch: the next epoch's iterator must draw its seeds
            # after the resumed RNG state is in place, as it did in the uninterrupted run.
            return self._deferred()
        inner = iter(self.loader)
        return self._skipping(inner, skip) if skip else inner

    def _deferred(self) -> Iterator:
        self._epoch_start_states = self._generator_states()
        yield from iter(self.loader)

    def _skipping(self, inner: Iterator, n: int) -> Iterator:
        _advance(inner, n, isinstance(self.loader.dataset, IterableDataset))
        yield from inner

    # -- random state --------------------------------------------------------------------
    def _generators(self) -> list[torch.Generator]:
        """The generators the epoch's order depends on (the loader's, the sampler's)."""
        found: list[torch.Generator] = []
        candidates = [self.loader.generator, getattr(self.loader.sampler, "generator", None)]
        batch_sampler = self.loader.batch_sampler
        if batch_sampler is not None:
            candidates.append(getattr(getattr(batch_sampler, "sampler", None), "generator", None))
        for gen in candidates:
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def _generator_states(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self._generators()]

    def unreplayable_order(self) -> bool:
        """True when the order comes from an unseeded ``RandomSampler`` (global RNG at ``iter``)."""
        samplers = [self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)]
        return any(isinstance(s, RandomSampler) and s.generator is None for s in samplers)


def _advance(inner: Iterator, n: int, iterable_dataset: bool) -> None:
    """Skip ``n`` batches; for a single-process map-style loader without loading them."""
    if not iterable_dataset and skip_sampled_indices(inner, n):
        return  # indices only: no __getitem__, no collation
    for _ in range(n):  # worker processes already hold indices: load and drop
        next(inner)
