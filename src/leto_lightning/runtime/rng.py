"""Random state a resume must put back: the process's generators, and a data loader's own.

Launcher- and framework-neutral (the Accelerate integration's payloads use it).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch


def _raw(state: torch.Tensor) -> bytes:
    """A generator state as bytes: pickled with every progress record, and a tensor pickles
    through torch's storage machinery (about 1000x slower than its 5 KB of bytes)."""
    return state.numpy().tobytes()


def _tensor(state: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.uint8) if isinstance(state, (bytes, bytearray)) else state


def rng_states() -> dict[str, Any]:
    """torch (CPU, and CUDA when initialised), Python and NumPy generators, as plain values
    (bytes, numbers, tuples): a checkpoint holding them loads with ``weights_only=True``."""
    states: dict[str, Any] = {"torch": _raw(torch.get_rng_state()), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        states["numpy"] = (str(name), np.asarray(keys, dtype="<u4").tobytes(), int(pos), int(has_gauss),
                           float(cached_gaussian))
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(_tensor(states["torch"]))
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy as np

        name, keys, pos, has_gauss, cached_gaussian = states["numpy"]
        np.random.set_state((name, np.frombuffer(keys, dtype="<u4").copy(), pos, has_gauss, cached_gaussian))
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def generator_states(generators: Iterable[torch.Generator]) -> list[bytes]:
    return [_raw(g.get_state()) for g in generators]


def set_generator_states(generators: Iterable[torch.Generator], states: list) -> None:
    for g, state in zip(generators, states):
        g.set_state(_tensor(state))
