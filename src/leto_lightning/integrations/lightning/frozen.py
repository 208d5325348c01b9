"""Resume payloads pickled once, when they are captured: the per-step record writes' cost.

Why: a step writes its payload to the progress record at prepare and again at commit (the
same payload), and the batch end records another. Pickling a payload is most of a record
write, and pickling a torch tensor the usual way (storages, the tensor rebuild protocol) costs
about 50 us each even for the 5 KB RNG state. ``FrozenPayload`` pickles the payload once, with
small CPU tensors reduced to their raw bytes, dtype and shape; the record then pickles only a
bytes object, however often it is written.

Reading a record needs nothing from here beyond this module being importable:
``FrozenPayload.__reduce__`` makes unpickling yield the payload itself (a tensor comes back as
an equal, independent CPU tensor), so ``store.record.read()`` and recovery see plain payloads.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import torch


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _plain(t: torch.Tensor) -> bool:
    """A tensor the raw-bytes form restores exactly: a plain, dense, non-empty CPU tensor with
    no autograd, names, conjugate/negative bit or quantization (anything else: torch's own way)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad and t.numel() > 0
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and not t.is_nested
            and not getattr(t, "has_names", bool)() and not t.__dict__)


def _reduce_tensor(t: torch.Tensor) -> Any:
    if not _plain(t):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return _tensor_from_bytes, (raw, t.dtype, tuple(t.shape))


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _reduce_tensor  # exact type: Parameters and subclasses keep torch's way


def dumps(payload: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return buf.getvalue()


class FrozenPayload:
    """A payload as it was when captured, pickled once (module doc)."""

    __slots__ = ("data",)

    def __init__(self, payload: Any) -> None:
        self.data = dumps(payload)

    def thaw(self) -> Any:
        """A fresh copy of the payload."""
        return pickle.loads(self.data)

    def __reduce__(self) -> tuple:
        return pickle.loads, (self.data,)  # unpickled, a record holds the payload itself

    def __repr__(self) -> str:
        return f"FrozenPayload({len(self.data)} bytes)"
