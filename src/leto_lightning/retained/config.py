"""Configuration of retained memory and its protection, validated when it is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..errors import ConfigurationError
from ..protection.checksum import CHECKSUM_ALGORITHM as HOST_CHECKSUM
from ..protection.checksum import available_algorithms
from ..protection.device import HASH_ALGORITHM as DEVICE_CHECKSUM

MiB = 1 << 20
PAGE_CHECKSUMS = ("auto", DEVICE_CHECKSUM, *available_algorithms())
BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RetainedConfig:
    """How retained state is paged, chunked and protected.

    page_bytes:   size of one page; the unit of checksums and erasure coding.
    chunk_pages:  pages per region in one chunk transaction (a chunk's working set -- params,
                  state and its undo copy -- should fit in the last-level cache).
    data_pages:   D, data pages per tier-1 protection group.
    tier1_parity: H1, Reed-Solomon parity pages per tier-1 group (repairs H1 lost pages).
    tier2_parity: H2, parity pages per tier-2 stripe (one page from each device of a node);
                  repairs the loss of H2 whole devices' state. Ignored with a single device.
    tier3_parity: 0 or 1: the cross-node tier for state no other node holds (plain FSDP2
                  shards): 1 keeps, on the next node's rank of the same local rank, a copy of
                  this rank's pages and metadata as of each step's prepare (a code over nodes
                  with k = 1, m = 1: a mirror, double-buffered), so a spare node can rebuild
                  a lost node's ranks (docs/spares.md). Memory: twice the rank's state on the
                  next node; traffic: the rank's state once per step.
    protect_grads: keep tier-1 parity over the retained gradients too, so a roll-forward
                  survives a damaged gradient page.
    record_bytes: capacity of one progress-record slot (four are kept: the newest two entries, twice each).
    engine:       erasure engine: "auto" (ISA-L when available, else torch), "isal", "torch".
    backend:      where the ``data`` and ``undo`` segments live: "auto" (where the model trains:
                  ``for_device``), "cpu" (POSIX shared memory) or "cuda" (device memory owned by a
                  state-manager process, opened through CUDA IPC; see docs/cuda-backend.md).
                  Metadata and parity stay in host memory either way.
    page_checksum: how pages are checksummed: "auto" (CRC-64 in host memory, the ``mul64-i32``
                  hash computed on the device with backend="cuda"), or one of them by name.
                  Choosing "mul64-i32" for host pages runs the device update path (parity
                  re-encoded and pages hashed with tensor operations) on the CPU: the tests do.
    """

    page_bytes: int = 1 * MiB
    chunk_pages: int = 1
    data_pages: int = 8
    tier1_parity: int = 1
    tier2_parity: int = 1
    tier3_parity: int = 0
    protect_grads: bool = True
    record_bytes: int = 1 * MiB
    engine: str = "auto"
    backend: str = "auto"
    page_checksum: str = "auto"

    def __post_init__(self) -> None:
        _positive("page_bytes", self.page_bytes)
        _positive("chunk_pages", self.chunk_pages)
        _positive("data_pages", self.data_pages)
        _positive("record_bytes", self.record_bytes)
        if self.page_bytes % 64:
            raise ConfigurationError(
                f"page_bytes={self.page_bytes} must be a multiple of 64 B (cache line, and every element size)"
            )
        for name in ("tier1_parity", "tier2_parity"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigurationError(f"{name}={value} must be >= 0")
        if self.tier3_parity not in (0, 1):
            raise ConfigurationError(f"tier3_parity={self.tier3_parity}: 0 (off) or 1 (a mirror of each rank's "
                                     "state on the next node)")
        if self.tier1_parity > self.data_pages:
            raise ConfigurationError(
                f"tier1_parity={self.tier1_parity} exceeds data_pages={self.data_pages}: more parity than data "
                "per group is wasted memory -- lower tier1_parity or raise data_pages"
            )
        if self.data_pages + self.tier1_parity > 255:
            raise ConfigurationError(
                f"data_pages + tier1_parity = {self.data_pages + self.tier1_parity} > 255: Reed-Solomon over GF(2^8) "
                "codes at most 255 pages per group"
            )
        if self.engine not in ("auto", "isal", "torch"):
            raise ConfigurationError(f"engine={self.engine!r}: choose 'auto', 'isal' or 'torch'")
        if self.backend not in BACKENDS:
            raise ConfigurationError(f"backend={self.backend!r}: choose 'auto' (where the model trains), 'cpu' "
                                     "(POSIX shared memory) or 'cuda' (device memory)")
        if self.page_checksum not in PAGE_CHECKSUMS:
            raise ConfigurationError(f"page_checksum={self.page_checksum!r}: choose one of {PAGE_CHECKSUMS}")
        if self.backend == "cuda" and self.page_checksum not in ("auto", DEVICE_CHECKSUM):
            raise ConfigurationError(f"page_checksum={self.page_checksum!r} with backend='cuda' would copy every "
                                     f"page to the host to checksum it: use 'auto' ({DEVICE_CHECKSUM} on the device)")

    def for_device(self, device_type: str) -> RetainedConfig:
        """This config for a model whose parameters are on a ``device_type`` ("cpu", "cuda")
        device: ``backend="auto"`` resolved. The retained views *are* the model's parameters, so
        they live where it trains; a backend naming another device is refused."""
        wanted = "cuda" if device_type == "cuda" else "cpu" if device_type == "cpu" else None
        if wanted is None:
            raise ConfigurationError(f"the model's parameters are on a {device_type!r} device: retained memory "
                                     "lives in host memory ('cpu') or in CUDA device memory ('cuda') -- train on one")
        if self.backend == "auto":
            return replace(self, backend=wanted)
        if self.backend != wanted:
            raise ConfigurationError(
                f"backend={self.backend!r} but the model's parameters are on {device_type}: the retained views are "
                f"the parameters, so they live where the model trains -- leave backend='auto' (or set {wanted!r})")
        return self

    @property
    def checksum_algorithm(self) -> str:
        """The page checksum ``page_checksum`` resolves to."""
        if self.page_checksum != "auto":
            return self.page_checksum
        return DEVICE_CHECKSUM if self.backend == "cuda" else HOST_CHECKSUM

    def check_devices(self, n_devices: int) -> None:
        """Tier 2 spans the devices of a node: validate H2 against how many there are."""
        if n_devices >= 2 and self.tier2_parity > n_devices:
            raise ConfigurationError(
                f"tier2_parity={self.tier2_parity} exceeds the {n_devices} devices per node it protects"
            )
        if n_devices + self.tier2_parity > 255:
            raise ConfigurationError(f"{n_devices} devices + tier2_parity={self.tier2_parity} > 255 (GF(2^8) limit)")

    def to_dict(self) -> dict:
        return asdict(self)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{name}={value!r} must be a positive integer")
