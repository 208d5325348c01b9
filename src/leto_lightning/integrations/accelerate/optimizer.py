"""The prepared optimizer of ``LetoAccelerator``: Accelerate's ``AcceleratedOptimizer`` whose
real step is a retained transaction.

``AcceleratedOptimizer.step`` keeps its semantics exactly -- nothing happens unless Accelerate
syncs gradients at this micro-step; with a GradScaler the update runs inside
``scaler.step()`` (skipped on inf/nan, ``step_was_skipped`` then true) followed by
``scaler.update()``. Only the innermost call changes: where Accelerate calls the torch
optimizer's ``step``, this runs ``LetoAccelerator._retained_step`` (prepare, chunk
transactions, commit). The torch optimizer's own ``step`` attribute (wrapped by LR schedulers)
is left alone, except for the moment Accelerate itself patches it inside ``scaler.step``.

Binding happens at ``prepare()`` once the optimizer's model is prepared; an optimizer whose
parameters belong to no prepared model (a model built after the optimizer, parameters remapped
after ``prepare()``) binds the parameters it holds at its first step (``bind_late``).

``zero_grad`` of the torch optimizer is the retained one (gradients are zeroed in place and stay
views into retained memory), still called by Accelerate only on sync micro-steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step
from typing_extensions import override

from ...errors import UsageError
from .internals import original_optimizer_step, settle_scaler_step


class LetoAcceleratedOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` stepping through retained memory (module doc)."""

    def __init__(self, optimizer: Any, device_placement: bool = True, scaler: Any = None,
                 bind_late: Callable[[], None] | None = None) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self._leto_step: Callable | None = None
        self._leto_bind_late = bind_late  # binds what the optimizer holds (module doc); raises if it cannot

    def bind_step(self, step: Callable[[Callable | None], Any]) -> None:
        """Once bound to retained memory: the retained step stands in for the torch step."""
        self._leto_step = step
        if self.scaler is not None:
            self._leto_patched = patch_optimizer_step(self, step)

    @override
    def step(self, closure: Callable | None = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        if self._leto_step is None and self._leto_bind_late is not None:
            self._leto_bind_late()
        if self._leto_step is None:
            raise UsageError("LetoAccelerator: this optimizer is not bound to retained memory yet -- pass its model "
                             "to accelerator.prepare() (in the same call or an earlier one) before the first step")
        if self.scaler is None:
            return self._leto_step(closure)
        self.optimizer.step = self._leto_patched
        try:
            self.scaler.step(self.optimizer, closure)
            self.scaler.update()
        finally:
            self.optimizer.step = original_optimizer_step(self)
        settle_scaler_step(self)  # step_was_skipped, from what Accelerate's patch recorded
        return None
