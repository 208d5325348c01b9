"""Binding the prepared model and optimizer to this rank's retained store.

Why after ``prepare()`` (after device placement and the DDP wrap) and not before: Accelerate
moves parameters (``cpu:0`` copies a ``cpu`` tensor), round-trips the optimizer's state dict
and wraps the model; views bound before any of it would be replaced. DDP keeps the parameter
objects, so re-pointing ``p.data`` and ``p.grad`` at retained views afterwards keeps every
gradient DDP reduces in retained memory (with ``gradient_as_bucket_view=False``, DDP copies the
reduced bucket into the existing ``.grad``).

Three cases:

- a new store (fresh start): the values after DDP's broadcast are copied in, parity encoded
  (tier 2 across the node's ranks), the store marked complete, shadows told they may attach;
- a continuation (a shadow, or ``LETO_RESUME=retained``): attach, bind views only, wait for
  promotion fully built (level 3), then take the committed payload -- every rank's retained
  parameters are the same committed values, so DDP's broadcast of the shadow's own initial
  weights (among the shadows) never reaches retained memory.
"""

from __future__ import annotations

import torch


def param_names(models: list[torch.nn.Module]) -> dict:
    """Parameter -> name, from the unwrapped models (names in the store's layout and reports)."""
    names: dict = {}
    for model in models:
        inner = getattr(model, "module", model)
        for name, p in inner.named_parameters():
            names.setdefault(p, name)
    return names
