"""Optimizer math on one chunk: torch's own functional optimizers over the chunk's pieces.

Calling ``torch.optim.adam.adam`` / ``torch.optim.sgd.sgd`` on slices of the flat buffers gives
results bit-identical to ``torch.optim.Adam(...).step()`` on the whole parameters: the math is
element-wise, and each piece (one parameter's part of the chunk) carries that parameter's own
step counter (see ``StoreLayout.chunk_pieces``).

Which of torch's implementations runs is the one the optimizer itself would run
(``uses_foreach``): on CUDA the multi-tensor ("foreach") kernels unless the param group says
``foreach=False``; on the CPU the single-tensor loop. They are *not* interchangeable bit for bit on
CUDA (float32: the foreach kernels round differently from the single-tensor ops), so the choice
follows the optimizer's, not convenience.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.sgd import sgd as functional_sgd

from ..errors import ConfigurationError


@dataclass
class ChunkPieces:
    """Tensors of the pieces of one chunk that take part in this update."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)  # 0-dim float32 views
    state: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def apply_update(family: str, hp: dict, pieces: ChunkPieces) -> None:
    """Run one optimizer step of ``family`` over ``pieces`` in place."""
    if not pieces.params:
        return
    if family == "adam":
        _adam(hp, pieces)
    elif family == "sgd":
        _sgd(hp, pieces)
    else:  # pragma: no cover - the layout rejects unknown families first
        raise ConfigurationError(f"no chunked math for optimizer family {family!r}")


def uses_foreach(hp: dict, params: list[torch.Tensor]) -> bool:
    """The implementation ``torch.optim`` picks for these params (``_default_to_fused_or_foreach``
    with ``fused`` off, which the binding refuses): ``foreach`` as the group sets it, else the
    multi-tensor kernels exactly when every param is a CUDA tensor."""
    chosen = hp.get("foreach")
    if chosen is not None:
        return bool(chosen)
    return bool(params) and all(p.is_cuda for p in params)


def _adam(hp: dict, pieces: ChunkPieces) -> None:
    amsgrad = bool(hp.get("amsgrad", False))
    beta1, beta2 = hp["betas"]
    functional_adam(
        pieces.params,
        pieces.grads,
        pieces.state["exp_avg"],
        pieces.state["exp_avg_sq"],
        pieces.state.get("max_exp_avg_sq", []) if amsgrad else [],
        pieces.steps,
        foreach=uses_foreach(hp, pieces.params),
        capturable=False,
        differentiable=False,
        fused=None,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        decoupled_weight_decay=bool(hp.get("decoupled_weight_decay", False)),
        amsgrad=amsgrad,
        beta1=beta1,
        beta2=beta2,
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        eps=hp["eps"],
        maximize=bool(hp.get("maximize", False)),
    )


def _sgd(hp: dict, pieces: ChunkPieces) -> None:
    momentum = hp.get("momentum", 0)
    # torch.optim.SGD initialises the buffer to a *copy* of the first gradient (not 0*m + g):
    # hand it None on a piece's first step and copy what it creates into retained memory.
    buffers = pieces.state["momentum_buffer"] if momentum else []
    passed: list[torch.Tensor | None] = (
        [buf if step.item() > 0 else None for buf, step in zip(buffers, pieces.steps)] if momentum
        else [None] * len(pieces.params)
    )
    functional_sgd(
        pieces.params,
        pieces.grads,
        passed,
        has_sparse_grad=False,
        foreach=uses_foreach(hp, pieces.params),
        fused=None,
        grad_scale=None,
        found_inf=None,
        weight_decay=hp.get("weight_decay", 0),
        momentum=momentum,
        lr=hp["lr"],
        dampening=hp.get("dampening", 0),
        nesterov=bool(hp.get("nesterov", False)),
        maximize=bool(hp.get("maximize", False)),
    )
    if momentum:
        for retained, produced in zip(buffers, passed):
            if produced is not None and produced is not retained:  # None: never, torch filled it
                retained.copy_(produced)
    for step in pieces.steps:
        step.add_(1)
