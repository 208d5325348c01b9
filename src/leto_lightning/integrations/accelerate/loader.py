"""Prepared data loaders that know their position and can be put back at it.

A prepared loader (Accelerate's ``DataLoaderShard``) gets a subclass of its own class (so
``isinstance`` and every attribute hold) whose ``__iter__``:

- records the epoch-start random state (the process's generators, the loader's own
  ``synchronized_generator``/sampler generator, a seedable sampler's initial seed): the shuffled
  order of a default ``RandomSampler`` depends on it at ``iter()`` time, not on the epoch
  number, and a ``SeedableRandomSampler``'s on the seed of the process that built it;
- counts the batches it yielded this pass (Accelerate's ``iteration`` counts the passes);
- calls the accelerator's per-batch hook before each batch reaches the loop (heartbeats, the
  resume payload of the step before, fault points);
- after ``leto_resume()``: restores the epoch-start state, runs the pass from its start and
  drops the batches the crashed run had consumed (the indices replay; their content is loaded
  and discarded, so a costly dataset pays for them once), then restores the random state the
  crashed run had at that point.

A loader holds its accelerator weakly (no reference cycle: ``del accelerator`` frees it, and its
retained memory, at once) and drops that reference when pickled. A dispatching loader (Accelerate's
``DataLoaderDispatcher``, the default for an ``IterableDataset``) gets the same subclass without
``resumable``: its batches get the per-batch hook, and a step trained from it is refused (it cannot
be put back at a position); evaluating or loading data with it is fine.

Why drop batches instead of ``skip_first_batches``: the loop holds this very object (``for
batch in train_dl``); a new loader would not be what it iterates. Prefetching: Accelerate
fetches batch ``j + 1`` before yielding ``j``; the replay does the same, so the random state is
restored at the same place relative to the fetches.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...runtime.rng import generator_states, rng_states, set_generator_states, set_rng_states
from .internals import set_loader_class


class BatchHooks(Protocol):
    """What a positioned loader calls on ``LetoAccelerator`` (a protocol: this module sits below it)."""

    def _leto_iter_started(self, loader: Any) -> None: ...

    def _leto_before_batch(self, loader: Any) -> None: ...

_CLASSES: dict[type, type] = {}


@dataclass
class Position:
    """Where a pass resumes: drop ``skip`` batches, then restore ``rng`` -- before the next
    fetch (``at_yield=False``: the state of a step's prepare) or once the next batch is fetched,
    just before it is yielded (``at_yield=True``: the state the per-batch hook saw)."""

    skip: int
    epoch_rng: dict
    rng: dict
    at_yield: bool


class _PositionedLoader:
    """Mixin placed before the prepared loader's class (see ``positioned``)."""

    _leto_accelerator: weakref.ref
    _leto_resumable: bool
    _leto_index: int
    _leto_yielded: int
    _leto_epoch_rng: dict | None
    _leto_pending: Position | None

    def _leto_generators(self) -> list[torch.Generator]:
        found: list[torch.Generator] = []
        for owner in (self, getattr(self, "base_dataloader", None)):
            for g in (getattr(owner, "synchronized_generator", None), getattr(owner, "generator", None),
                      getattr(getattr(owner, "sampler", None), "generator", None)):
                if isinstance(g, torch.Generator) and all(g is not h for h in found):
                    found.append(g)
        batch_sampler = getattr(getattr(self, "base_dataloader", None), "batch_sampler", None)
        inner = getattr(getattr(batch_sampler, "batch_sampler", batch_sampler), "sampler", None)
        g = getattr(inner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
        return found

    def _leto_seeded_samplers(self) -> list:
        """Accelerate's ``SeedableRandomSampler``s: their order is a function of ``initial_seed``
        (the process's ``torch.initial_seed()`` when built) and the epoch."""
        base = getattr(self, "base_dataloader", None)
        batch_sampler = getattr(base, "batch_sampler", None)
        found = [getattr(base, "sampler", None), getattr(batch_sampler, "sampler", None),
                 getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)]
        out: list = []
        for sampler in found:
            if hasattr(sampler, "initial_seed") and all(sampler is not s for s in out):
                out.append(sampler)
        return out

    def _leto_random_state(self) -> dict:
        return {"process": rng_states(), "loader": generator_states(self._leto_generators()),
                "seeds": [s.initial_seed for s in self._leto_seeded_samplers()]}

    def _leto_set_random_state(self, state: dict) -> None:
        set_rng_states(state["process"])
        set_generator_states(self._leto_generators(), state["loader"])
        for sampler, seed in zip(self._leto_seeded_samplers(), state.get("seeds", ())):
            sampler.initial_seed = seed

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_leto_accelerator", None)  # a weak reference; an unpickled loader is a plain one
        return state

    def __iter__(self) -> Iterator[Any]:
        if self._leto_accelerator() is None:  # the accelerator is gone: a plain loader
            yield from super().__iter__()  # type: ignore[misc]
            return
        self._leto_hooks()._leto_iter_started(self)
        pending, self._leto_pending = self._leto_pending, None
        if pending is not None:
            self._leto_set_random_state(pending.epoch_rng)
        self._leto_epoch_rng = self._leto_random_state()
        self._leto_yielded = 0
        batches = super().__iter__()  # type: ignore[misc]
        restore_at_yield = None
        if pending is not None:
            for _ in range(pending.skip):
                if next(batches, _END) is _END:
                    break
                self._leto_yielded += 1
            if pending.at_yield:
                restore_at_yield = pending.rng
            else:
                self._leto_set_random_state(pending.rng)
        for batch in batches:
            if restore_at_yield is not None:
                self._leto_set_random_state(restore_at_yield)
                restore_at_yield = None
            self._leto_hooks()._leto_before_batch(self)
            self._leto_yielded += 1
            yield batch

    def _leto_hooks(self) -> BatchHooks:
        hooks = self._leto_accelerator()
        return hooks if hooks is not None else _NO_HOOKS

    def leto_position(self) -> dict:
        """This pass's position now: its epoch (Accelerate's pass counter), the batches yielded so
        far (inside the per-batch hook: the ones before the batch about to be yielded), the
        epoch-start random state and the random state now."""
        return {"index": self._leto_index, "epoch": int(getattr(self, "iteration", 0)),
                "yielded": self._leto_yielded, "epoch_rng": self._leto_epoch_rng, "rng": self._leto_random_state()}


class _NoHooks:
    """What a loader calls once its accelerator is gone: nothing."""

    def _leto_iter_started(self, loader: Any) -> None:
        pass

    def _leto_before_batch(self, loader: Any) -> None:
        pass


_NO_HOOKS = _NoHooks()
_END = object()


def positioned(loader: Any, accelerator: BatchHooks, index: int, resumable: bool = True) -> Any:
    """Turn a prepared loader into its positioned subclass, in place (the same object);
    ``resumable=False``: a loader that cannot be put back at a position (module doc)."""
    cls = type(loader)
    if isinstance(loader, _PositionedLoader):
        return loader
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Leto{cls.__name__}", (_PositionedLoader, cls), {"__module__": __name__})
    set_loader_class(loader, _CLASSES[cls])
    loader._leto_accelerator = weakref.ref(accelerator)
    loader._leto_resumable = resumable
    loader._leto_index = index
    loader._leto_yielded = 0
    loader._leto_epoch_rng = None
    loader._leto_pending = None
    return loader


def is_positioned(loader: Any) -> bool:
    return isinstance(loader, _PositionedLoader)


def is_resumable(loader: Any) -> bool:
    """Whether a step trained from ``loader``'s batches can be resumed at its position (an
    unprepared loader, or None: the loop positions itself, as before)."""
    return not isinstance(loader, _PositionedLoader) or loader._leto_resumable
