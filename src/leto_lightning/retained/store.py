"""RetainedStore: one rank's retained memory and the views the trainer works on.

Segments of one rank (CPU backend: POSIX shared memory, named ``leto-<job>-r<rank>-<what>``):

- ``data``:    every page of every region (params, grads, optimizer state; see layout.py);
- ``undo``:    the undo buffer -- the old contents of the one chunk in flight;
- ``parity1``: tier-1 parity pages (host memory);
- ``meta``:    chunk table (version, phase), optimizer step counters, page checksums, undo
               header, and the two progress-record slots;
- ``spec``:    the pickled ``StoreSpec``, so a process that only knows (job, rank) can attach.

and one per node: ``leto-<job>-node<k>-parity2`` with the tier-2 stripes.

With ``RetainedConfig(backend="cuda")`` the ``data`` and ``undo`` segments are device memory
owned by a state-manager process and opened through CUDA IPC (``backends.cuda_ipc``): the views
below are then CUDA tensors. Everything else stays in host shared memory (parity lives in host
memory, DESIGN.md 2.2).

The process that *creates* the segments owns them (the state manager); trainers attach.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import ConfigurationError
from ..faults.points import point
from ..protection.groups import Tier1Plan, Tier2Plan
from .config import RetainedConfig
from .layout import ParamSlot, StoreLayout, dtype_of
from .record import ProgressRecord
from .shm import SHM_DIR, SharedSegment, segment_name, unlink_segment

# Chunk phases (meta chunk table, column 1). A chunk is "in flight" from UNDO_SAVED until its
# commit mark puts it back to IDLE at the new version.
IDLE, UNDO_SAVED, MATH_DONE, TIER1_DONE, TIER2_DONE, CHECKSUMMED = range(6)
PHASE_NAMES = ("idle", "undo_saved", "math_done", "tier1_done", "tier2_done", "checksummed")

# Undo header (int64 words): chunk, version, n_pages, n_pieces, then one crc per page, then
# the pieces' old step counters (float64 bits).
UNDO_CHUNK, UNDO_VERSION, UNDO_NPAGES, UNDO_NPIECES, UNDO_CRCS = range(5)
UNDO_WHOLE = -1  # UNDO_CHUNK value of a whole-state transaction (generic optimizers)
FLAG_GENERIC_STATE_BOUND = 0  # flags word: the generic optimizer's lazily created state lives in the store
DEVICE_SEGMENTS = ("data", "undo")  # what backend="cuda" puts in device memory


@dataclass(frozen=True)
class StoreSpec:
    """Everything needed to (re)build a rank's views: picklable, no tensors."""

    job_id: str
    rank: int
    node: int
    local_rank: int
    n_local: int
    layout: StoreLayout
    config: RetainedConfig
    device_manager: str = ""  # backend="cuda": address of the state manager holding data and undo

    def name(self, what: str) -> str:
        return segment_name(self.job_id, f"r{self.rank}", what)

    def node_name(self, what: str) -> str:
        return segment_name(self.job_id, f"node{self.node}", what)

    @cached_property
    def tier1(self) -> Tier1Plan:
        return Tier1Plan(self.layout, self.config.data_pages, self.config.tier1_parity, self.config.protect_grads)

    @cached_property
    def tier2(self) -> Tier2Plan:
        return Tier2Plan(self.layout, self.n_local, self.config.tier2_parity)

    @property
    def meta_words(self) -> dict[str, int]:
        """Sizes (in 8-byte words) of the meta sub-arrays, in order."""
        lay = self.layout
        return {
            "chunks": 2 * lay.n_chunks,
            "steps": lay.n_pieces,
            "crcs": lay.n_pages,
            "undo": UNDO_CRCS + lay.max_chunk_update_pages + lay.max_chunk_pieces,
            "scalars": len(lay.params) * len(lay.scalar_kinds),
            "flags": 8,
        }

    @property
    def whole_state(self) -> bool:
        """Generic optimizers update everything in one transaction: the undo buffer holds it all."""
        return self.layout.family == "generic"

    def undo_bytes(self) -> int:
        lay = self.layout
        if not self.whole_state:
            return max(1, lay.max_chunk_update_pages) * lay.page_bytes
        # backups of crcs, steps, scalars and flags
        backups = len(lay.update_pages) + lay.n_pieces + self.meta_words["scalars"] + self.meta_words["flags"]
        return len(lay.update_pages) * lay.page_bytes + 8 * backups

    def sizes(self) -> dict[str, int]:
        lay, cfg = self.layout, self.config
        meta = 8 * sum(self.meta_words.values()) + 2 * cfg.record_bytes
        return {
            "data": lay.data_bytes,
            "undo": self.undo_bytes(),
            "parity1": max(1, self.tier1.n_groups * cfg.tier1_parity) * lay.page_bytes,
            "meta": meta,
        }

    def parity2_bytes(self) -> int:
        return max(1, self.tier2.n_stripes * self.config.tier2_parity) * self.layout.page_bytes


class RetainedStore:
    """Views over one rank's retained segments (created here, or attached)."""

    def __init__(self, spec: StoreSpec, segments: dict[str, SharedSegment]) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.config = spec.config
        self.segments = segments
        self._build_views()
        self._t2_lock_fd: int | None = None

    # -- creation and attachment -------------------------------------------------------
    @classmethod
    def create(cls, spec: StoreSpec) -> "RetainedStore":
        """Allocate every segment of ``spec.rank`` (the node's tier-2 segment too, for local rank 0)."""
        if spec.config.backend == "cuda":
            spec = _with_device_manager(spec)
        created: dict[str, SharedSegment] = {}
        try:
            for what, nbytes in spec.sizes().items():
                created[what] = _new_segment(spec, what, nbytes)
            blob = pickle.dumps(spec)
            created["spec"] = SharedSegment.create(spec.name("spec"), len(blob))
            created["spec"].tensor.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            if spec.tier2.enabled:
                created["parity2"] = _create_or_attach(spec.node_name("parity2"), spec.parity2_bytes())
        except BaseException:
            for seg in created.values():
                seg.close()
                seg.unlink()
            if spec.device_manager:
                from .backends.cuda_ipc import stop_private
                stop_private(spec.device_manager)
            raise
        return cls(spec, created)

    @classmethod
    def attach(cls, job_id: str, rank: int) -> "RetainedStore":
        spec_seg = SharedSegment.attach(segment_name(job_id, f"r{rank}", "spec"))
        spec: StoreSpec = pickle.loads(bytes(spec_seg.tensor.numpy()))
        segs = {"spec": spec_seg}
        for what in spec.sizes():
            segs[what] = _open_segment(spec, what)
        if spec.tier2.enabled:
            segs["parity2"] = SharedSegment.attach(spec.node_name("parity2"))
        return cls(spec, segs)

    @contextmanager
    def tier2_lock(self, chunk: int):
        """Serialise tier-2 parity updates of one chunk's stripes across the node's ranks.

        An fcntl record lock: the kernel releases it when its holder dies, so a SIGKILLed
        rank never leaves the others waiting.
        """
        if self._t2_lock_fd is None:
            path = os.path.join(SHM_DIR, self.spec.node_name("t2lock"))
            self._t2_lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.lockf(self._t2_lock_fd, fcntl.LOCK_EX, 1, chunk)
        try:
            yield
        finally:
            fcntl.lockf(self._t2_lock_fd, fcntl.LOCK_UN, 1, chunk)

    def segment_names(self) -> list[str]:
        return [s.name for s in self.segments.values()]

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        if self._t2_lock_fd is not None:
            os.close(self._t2_lock_fd)
            self._t2_lock_fd = None

    def unlink(self) -> None:
        """Free this rank's retained memory (the node's tier-2 segment too)."""
        for seg in self.segments.values():
            seg.unlink()
        unlink_segment(self.spec.node_name("t2lock"))

    # -- views ---------------------------------------------------------------------------
    def _build_views(self) -> None:
        lay, cfg = self.layout, self.config
        pb = lay.page_bytes
        self.data = self.segments["data"].tensor
        self.pages = self.data[: lay.n_pages * pb].view(lay.n_pages, pb) if lay.n_pages else self.data[:0].view(0, pb)
        self.undo = self.segments["undo"].tensor
        n1 = self.spec.tier1.n_groups
        self.parity1 = self.segments["parity1"].tensor[: n1 * cfg.tier1_parity * pb].view(n1, cfg.tier1_parity, pb)
        if self.spec.tier2.enabled:
            n2 = self.spec.tier2.n_stripes
            self.parity2 = self.segments["parity2"].tensor[: n2 * cfg.tier2_parity * pb].view(n2, cfg.tier2_parity, pb)
        else:
            self.parity2 = None
        meta = self.segments["meta"].tensor
        words = meta[: 8 * sum(self.spec.meta_words.values())].view(torch.int64)
        offset = 0
        views = {}
        for key, n in self.spec.meta_words.items():
            views[key] = words[offset : offset + n]
            offset += n
        self.chunk_table = views["chunks"].view(lay.n_chunks, 2)  # [version, phase]
        # Optimizer step counter per piece (float32, like torch.optim's ``state["step"]``; the
        # word array is twice as large as needed).
        self.steps = views["steps"].view(torch.float32)[: lay.n_pieces]
        self.crcs = views["crcs"]
        self.undo_header = views["undo"]
        n_scalars = len(lay.params) * len(lay.scalar_kinds)
        self.scalars = views["scalars"].view(torch.float32)[:n_scalars].view(len(lay.params), len(lay.scalar_kinds))
        self.flags = views["flags"]
        self.record = ProgressRecord(meta[8 * offset : 8 * offset + 2 * cfg.record_bytes],
                                     on_half_written=lambda: point("record.half_written"))

    def page(self, p: int) -> torch.Tensor:
        return self.pages[p]

    def region_view(self, segment: int, kind: str) -> torch.Tensor:
        """A typed 1-D view of one whole region (padded length)."""
        r = self.layout.region(segment, kind)
        seg = self.layout.segments[segment]
        raw = self.data[r.first_page * self.layout.page_bytes : (r.first_page + r.n_pages) * self.layout.page_bytes]
        return raw.view(dtype_of(seg.dtype))[: seg.padded_numel]

    def param_view(self, slot: ParamSlot, kind: str) -> torch.Tensor:
        """``kind`` buffer of one parameter, shaped like the parameter."""
        region = self.region_view(slot.segment, kind)
        return region[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def chunk_view(self, chunk: int, kind: str) -> torch.Tensor:
        """The elements of chunk ``chunk`` in the ``kind`` region."""
        seg = self.layout.segments[int(self.layout.chunk_segment[chunk])]
        elems = self.layout.chunk_bytes // seg.elem_size
        start = (chunk - seg.first_chunk) * elems
        return self.region_view(seg.index, kind)[start : start + elems]

    def undo_view(self, n_pages: int) -> torch.Tensor:
        return self.undo[: n_pages * self.layout.page_bytes].view(n_pages, self.layout.page_bytes)

    # -- metadata helpers ----------------------------------------------------------------
    def versions(self) -> torch.Tensor:
        return self.chunk_table[:, 0]

    def phases(self) -> torch.Tensor:
        return self.chunk_table[:, 1]

    def in_flight(self) -> list[int]:
        return torch.nonzero(self.phases() != IDLE).flatten().tolist()


def _create_or_attach(name: str, nbytes: int) -> SharedSegment:
    """The node's tier-2 segment is shared by its ranks: the first one creates it."""
    try:
        return SharedSegment.create(name, nbytes)
    except FileExistsError:
        seg = SharedSegment.attach(name)
        if seg.nbytes != nbytes:
            raise ConfigurationError(f"tier-2 segment {name} has {seg.nbytes} B, expected {nbytes} B (layouts differ?)")
        return seg


def _with_device_manager(spec: StoreSpec) -> StoreSpec:
    """backend="cuda": fail early and clearly without CUDA, and record (in the spec every
    attacher reads) which state manager holds the device memory."""
    from .backends import cuda_ipc

    cuda_ipc.require_cuda()
    if spec.device_manager:
        return spec
    return dataclasses.replace(spec, device_manager=cuda_ipc.manager_for_new_store(f"{spec.job_id}-r{spec.rank}"))


def _new_segment(spec: StoreSpec, what: str, nbytes: int):
    if spec.config.backend == "cuda" and what in DEVICE_SEGMENTS:
        from .backends.cuda_ipc import CudaSegment

        return CudaSegment.create(spec.name(what), nbytes, spec.device_manager)
    return SharedSegment.create(spec.name(what), nbytes)


def _open_segment(spec: StoreSpec, what: str):
    if spec.config.backend == "cuda" and what in DEVICE_SEGMENTS:
        from .backends.cuda_ipc import CudaSegment

        return CudaSegment.attach(spec.name(what), spec.device_manager)
    return SharedSegment.attach(spec.name(what))
