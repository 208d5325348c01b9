"""Optimizer state as torch shows it: a parameter's entry appears at the step that first
updates it.

Binding makes every parameter's optimizer state (SGD's momentum buffer, Adam's moments and
step) a view into retained memory at ``prepare()``; the chunk transactions update the store,
not ``optimizer.state``. torch creates a parameter's state at its first update, so before
that ``optimizer.state_dict()["state"]`` is ``{}`` -- and code that snapshots it (a script
comparing a reloaded state, Accelerate's own tests, a checkpoint saved before the first step)
must see the same here. So entries whose step counter is still 0 are held back and put in
once it moves. SGD without momentum keeps no state in torch: its (empty) entries never show.

Only the chunk-wise families (SGD, Adam, AdamW) of the plain binding: other optimizers' state
is adopted after torch created it (``updater.whole_state``); FSDP2 and ZeRO-1 show their state
through their own bindings.
"""

from __future__ import annotations

import torch

from ...updater.retained_optimizer import RetainedOptimizer


class ShownState:
    """Which of ``ro``'s optimizer-state entries ``optimizer.state`` shows (module doc)."""

    def __init__(self, ro: RetainedOptimizer) -> None:
        self.ro = ro
        self.held: dict[torch.nn.Parameter, dict] = {}

    def _started(self, index: int) -> bool:
        ro = self.ro
        return bool(ro.store.steps[ro.layout.param_first_piece[index]] > 0)

    def refresh(self) -> None:
        """After binding or loading: hold back every entry of a parameter not yet updated."""
        state = self.ro.optimizer.state
        self.held = {}
        for index, p in enumerate(self.ro.params):
            entry = state.get(p)
            if entry is None:
                continue
            if not entry or not self._started(index):
                self.held[p] = state.pop(p)
        self._drop_empty()

    def after_step(self) -> None:
        """Entries whose parameter this step updated for the first time appear."""
        if not self.held:
            return
        state = self.ro.optimizer.state
        for index, p in enumerate(self.ro.params):
            entry = self.held.get(p)
            if entry and self._started(index):
                state[p] = self.held.pop(p)
        self._drop_empty()

    def _drop_empty(self) -> None:
        """Empty entries (SGD without momentum) stay hidden for good: nothing left to watch."""
        self.held = {p: entry for p, entry in self.held.items() if entry}


def shows_torch_state(ro: RetainedOptimizer) -> bool:
    """Whether ``ShownState`` applies to this binding (module doc)."""
    return type(ro) is RetainedOptimizer and ro.layout.family in ("sgd", "adam")
