"""Erasure engines: who does the bulk GF(2^8) arithmetic on pages.

``get_engine("auto")`` picks ISA-L (SIMD C, memory speed on host) when the library can
be loaded, otherwise pure torch, and logs once why ISA-L was not used.
"""

from __future__ import annotations

import logging
import threading

from ...errors import ConfigurationError
from ..errors import EngineUnavailableError
from .base import ErasureEngine
from .isal import IsalEngine, load_isal
from .torch_engine import TorchEngine

__all__ = ["ErasureEngine", "IsalEngine", "TorchEngine", "available_engines", "get_engine"]

log = logging.getLogger(__name__)
_ENGINES: dict[str, ErasureEngine] = {}
_lock = threading.Lock()
_warned = False

_HOW_TO_GET_ISAL = (
    "install it with `pip install pyeclib` (its wheel bundles libisal) or the system package "
    "`libisal2` (Debian/Ubuntu), or point LETO_ISAL_LIBRARY at libisal.so"
)


def available_engines() -> list[str]:
    """Names of the engines that can run here, fastest on host first."""
    lib, _ = load_isal()
    return (["isal"] if lib is not None else []) + ["torch"]


def _make(name: str) -> ErasureEngine:
    if name == "isal":
        lib, why = load_isal()
        if lib is None:
            raise EngineUnavailableError(f"ISA-L engine unavailable: {why}; {_HOW_TO_GET_ISAL}")
        return IsalEngine()
    if name == "torch":
        return TorchEngine()
    raise ConfigurationError(f"unknown erasure engine {name!r}; choose 'auto', 'isal' or 'torch'")


def get_engine(name: str = "auto") -> ErasureEngine:
    """Shared engine instance by name: ``"auto"``, ``"isal"`` or ``"torch"``."""
    global _warned
    if name == "auto":
        lib, why = load_isal()
        if lib is None:
            with _lock:
                if not _warned:
                    _warned = True
                    log.warning("ISA-L not found, using the slower torch erasure engine: %s; %s", why, _HOW_TO_GET_ISAL)
        name = "isal" if lib is not None else "torch"
    with _lock:
        engine = _ENGINES.get(name)
        if engine is None:
            engine = _ENGINES[name] = _make(name)
        return engine
