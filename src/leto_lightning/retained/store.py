"""RetainedStore: one rank's retained memory and the views the trainer works on.

Segments of one rank (CPU backend: POSIX shared memory, named ``leto-<job>-r<rank>-<what>``):

- ``data``:    every page of every region (params, grads, optimizer state; see layout.py);
- ``undo``:    the undo buffer -- the old contents of the one chunk in flight;
- ``parity1``: tier-1 parity pages (host memory);
- ``meta``:    page-aligned areas: the *primary* metadata (chunk table [version, phase], optimizer
               step counters, page checksums, scalar state, flags, and checksum words over them),
               its *mirror* (a second copy), two copies of the undo header, and the two
               progress-record slots (``integrity.py`` keeps them consistent and checked);
- ``spec``:    the ``StoreSpec`` as checksummed JSON, twice, and the completion mark
               (``spec.py``), so a process that only knows (job, rank) can attach.

and one per node: ``leto-<job>-node<k>-parity2`` with the tier-2 stripes.

With ``RetainedConfig(backend="cuda")`` the ``data`` and ``undo`` segments are device memory
owned by a state-manager process and opened through CUDA IPC (``backends.cuda_ipc``): the views
below are then CUDA tensors. Everything else stays in host shared memory (parity lives in host
memory, docs/design.md 2.2).

The process that *creates* the segments owns them (the state manager); trainers attach.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from collections.abc import Sequence
from contextlib import contextmanager
from enum import IntEnum

import torch

from ..env import ProcessSettings
from ..errors import ConfigurationError, IncompleteStoreError, InternalError, UnrecoverableDamageError
from ..faults.points import point
from ..protection.checksum import checksum
from ..protection.device import HASH_ALGORITHM as DEVICE_CHECKSUM
from ..protection.device import page_hashes
from .layout import ParamSlot, dtype_of
from .record import ProgressRecord
from .shm import SHM_DIR, SharedSegment, require_capacity, segment_name, unlink_segment
from .spec import (  # noqa: F401  (re-exported: the spec used to live here)
    UNDO_CHUNK,
    UNDO_CRCS,
    UNDO_NPAGES,
    UNDO_NPIECES,
    UNDO_VERSION,
    SpecUnreadableError,
    StoreSpec,
    any_mark,
    read_spec,
    repair_spec_segment,
    valid_marks,
    write_marks,
    write_spec,
)


class ChunkPhase(IntEnum):
    """Chunk phases (meta chunk table, column 1: the values are in shared memory), for reports:
    which sub-step a chunk reached. Recovery does not trust them: a chunk is in flight when the
    (checksummed) undo header names it and its (checksummed) commit mark does not show the new
    version."""

    IDLE = 0
    UNDO_SAVED = 1
    MATH_DONE = 2
    TIER1_DONE = 3
    TIER2_DONE = 4
    CHECKSUMMED = 5

    @classmethod
    def label(cls, value: int) -> str:
        """The name of the phase a table holds (``"math_done"``); ``"unknown"`` for a value that
        is no phase (damaged memory)."""
        try:
            return cls(value).name.lower()
        except ValueError:
            return "unknown"


UNDO_WHOLE = -1  # UNDO_CHUNK value of a whole-state transaction (generic optimizers)
FLAG_GENERIC_STATE_BOUND = 0  # flags word: the generic optimizer's lazily created state lives in the store
DEVICE_SEGMENTS = ("data", "undo")  # what backend="cuda" puts in device memory
_HASH_RUN = 256  # pages hashed in one batch (recovery verifies every page)


def to_i64(value: int) -> int:
    """An unsigned 64-bit checksum as the int64 tables keep it."""
    return value - (1 << 64) if value >= (1 << 63) else value


class StoreMissingError(IncompleteStoreError, FileNotFoundError):
    """A segment of the store does not exist (never created, or already freed)."""


class RetainedStore:
    """Views over one rank's retained segments (created here, or attached)."""

    def __init__(self, spec: StoreSpec, segments: dict[str, SharedSegment]) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.config = spec.config
        self.segments = segments
        self.spec_crc = 0
        self.spec_findings: list[str] = []  # spec copies found damaged at attach (recovery rewrites them)
        self._build_views()
        self._t2_lock_fd: int | None = None
        self._pinned: list[torch.Tensor] = []  # host segments registered with CUDA (pin_host_parity)

    # -- creation and attachment -------------------------------------------------------
    @classmethod
    def create(cls, spec: StoreSpec, settings: ProcessSettings | None = None) -> RetainedStore:
        """Allocate every segment of ``spec.rank`` (the node's tier-2 segment too, for local rank 0).

        ``settings`` (``ProcessSettings.from_env()`` where the caller reads the environment):
        backend="cuda" without ``spec.device_manager`` allocates from ``settings.cuda_manager``,
        else from a private manager whose socket goes in ``settings.manager_dir``.

        The store is not *complete* until its creator calls ``mark_complete()`` once the views are
        bound and all parity is encoded (tier 2 included): a half-initialised store is refused by
        recovery with ``IncompleteStoreError``.
        """
        if spec.config.backend == "cuda":
            spec = _with_device_manager(spec, settings or ProcessSettings())
        require_capacity(_host_bytes(spec), f"rank {spec.rank}'s retained store")  # before allocating anything
        created: dict[str, SharedSegment] = {}
        try:
            for what, nbytes in spec.sizes().items():
                created[what] = _new_segment(spec, what, nbytes)
            created["spec"] = SharedSegment.create(spec.name("spec"), spec.spec_bytes())
            write_spec(created["spec"].tensor, spec)  # the marks stay zero: not complete
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
        store = cls(spec, created)
        store.spec_crc = read_spec(created["spec"].tensor, spec.name("spec"))[1]
        return store

    @classmethod
    def attach(cls, job_id: str, rank: int) -> RetainedStore:
        """Map an existing store. Raises ``StoreMissingError`` (an ``IncompleteStoreError`` and a
        ``FileNotFoundError``) when a segment does not exist, and ``IncompleteStoreError`` /
        ``UnrecoverableDamageError`` when no copy of the spec is intact. Does *not* require the
        completion mark (tier-2 set-up attaches peers before it is written): ``recover_node`` and
        ``RetainedOptimizer.bind(adopt=True)`` check it."""
        name = segment_name(job_id, f"r{rank}", "spec")
        spec_seg = _attach_or_missing(name, job_id, rank)
        try:
            spec, crc, findings = read_spec(spec_seg.tensor, name)
        except SpecUnreadableError as exc:
            never_marked = not any_mark(spec_seg.tensor)
            spec_seg.close()
            if never_marked:
                raise IncompleteStoreError(
                    f"rank {rank} of job {job_id}: no intact spec in segment {name} and no completion mark: the store "
                    "was half-initialised (its creator died during set-up). Start from the last checkpoint (or "
                    "afresh) and free it with `leto cleanup`.") from None
            raise UnrecoverableDamageError({}, [str(exc) + "."]) from None
        segs = {"spec": spec_seg}
        try:
            for what in spec.sizes():
                segs[what] = _open_segment(spec, what)
            if spec.tier2.enabled:
                segs["parity2"] = _attach_or_missing(spec.node_name("parity2"), job_id, rank)
            store = cls(spec, segs)
        except BaseException:
            for seg in segs.values():
                seg.close()
            raise
        store.spec_crc, store.spec_findings = crc, findings
        return store

    # -- the completion mark ------------------------------------------------------------
    def mark_complete(self) -> None:
        """Write the "completely initialised and protected" mark: call it last in set-up, once
        every local rank's views are bound and all parity (tier 2 included) is encoded."""
        write_marks(self.segments["spec"].tensor, self.spec_crc)

    def clear_complete(self) -> None:
        """Withdraw the mark (the store is being initialised again)."""
        write_marks(self.segments["spec"].tensor, None)

    def is_complete(self) -> bool:
        """True when a valid completion mark for this store's spec is present."""
        return bool(valid_marks(self.segments["spec"].tensor, self.spec_crc))

    def require_complete(self) -> None:
        """Raise ``IncompleteStoreError`` when the store was never completely initialised."""
        if self.is_complete():
            return
        if any_mark(self.segments["spec"].tensor):
            raise UnrecoverableDamageError({}, [
                f"rank {self.spec.rank}: segment {self.spec.name('spec')}: both copies of the completion mark are "
                "damaged (the store did complete its set-up)."])
        if not self.is_complete():
            raise IncompleteStoreError(
                f"rank {self.spec.rank}: retained store {self.spec.name('*')} has no valid completion mark: it was "
                "half-initialised (its creator died during set-up, before all parity was encoded). Its contents "
                "cannot be trusted: start from the last checkpoint (or afresh) and free it (`leto cleanup`).")

    def rewrite_damaged_copies(self) -> list[str]:
        """Verify both copies of the spec, of the completion mark and of each progress-record
        entry, and rewrite every damaged copy from its intact twin (recovery, once
        ``require_complete`` passed); returns what was rewritten. A copy left damaged would
        lose the store at the next hit on its twin."""
        done = repair_spec_segment(self.segments["spec"].tensor, self.spec.name("spec"), self.spec_crc)
        self.spec_findings = []
        done += [f"segment {self.spec.name('meta')}: progress-record slot {i} (rewritten from its twin)"
                 for i in self.record.repair_copies()]
        return done

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

    def pin_host_parity(self) -> None:
        """With pages in device memory: page-lock the host parity segments in this process, so
        parity computed on the device is copied into them by DMA (``cudaHostRegister``). Once per
        process; ``close`` undoes it. Where CUDA refuses, copies are just slower."""
        if self._pinned or self.pages.device.type != "cuda":
            return
        from .backends.cuda_ipc import register_host

        for what in ("parity1", "parity2"):
            seg = self.segments.get(what)
            if seg is not None and register_host(seg.tensor):
                self._pinned.append(seg.tensor)

    def close(self) -> None:
        if self._pinned:
            from .backends.cuda_ipc import unregister_host

            for tensor in self._pinned:
                unregister_host(tensor)
            self._pinned = []
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
            parity2 = self.segments["parity2"].tensor[: n2 * cfg.tier2_parity * pb]
            self.parity2: torch.Tensor | None = parity2.view(n2, cfg.tier2_parity, pb)
        else:
            self.parity2 = None
        self._build_meta_views(self.segments["meta"].tensor)

    def _build_meta_views(self, meta: torch.Tensor) -> None:
        lay, cfg = self.layout, self.config
        areas, offset = {}, 0
        for name, fields in self.spec.meta_areas.items():
            words = meta[offset : offset + 8 * sum(fields.values())].view(torch.int64)
            at, views = 0, {}
            for key, n in fields.items():
                views[key] = words[at : at + n]
                at += n
            areas[name] = views
            offset += max(4096, -(-8 * sum(fields.values()) // 4096) * 4096)
        primary, mirror = areas["primary"], areas["mirror"]
        self.chunk_table = primary["chunks"].view(lay.n_chunks, 2)  # [version, phase]
        # Optimizer step counter per piece (float32, like torch.optim's ``state["step"]``; the
        # word array is twice as large as needed).
        self.steps = primary["steps"].view(torch.float32)[: lay.n_pieces]
        self.crcs = primary["crcs"]
        n_params, n_kinds = len(lay.params), len(lay.scalar_kinds)
        self.scalars = primary["scalars"].view(torch.float32)[: n_params * n_kinds].view(n_params, n_kinds)
        self.flags = primary["flags"]
        self.sums = primary["sums"]  # checksum words: one per chunk, the gradients', the scalar state's
        self.mirror = mirror  # versions, steps, crcs, scalars, flags, sums: the second copy
        self.undo_copies = (areas["undo0"]["words"], areas["undo1"]["words"])
        self.undo_progress = areas["progress"]["undo_bytes"]  # bytes per kind in the undo copy; -1: all
        self.record = ProgressRecord(meta[offset : offset + 4 * cfg.record_bytes],
                                     on_half_written=lambda: point("record.half_written"), copies=2)

    def page(self, p: int) -> torch.Tensor:
        return self.pages[p]

    @property
    def checksum_algorithm(self) -> str:
        """How this store's pages are checksummed (``RetainedConfig.page_checksum``, resolved)."""
        return self.config.checksum_algorithm

    @property
    def hashes_on_device(self) -> bool:
        """Pages are checksummed by tensor operations where they live (``protection.device``):
        true on a device; on the host only when configured so (the tests of that path)."""
        return self.checksum_algorithm == DEVICE_CHECKSUM

    def page_checksums(self, pages: Sequence[int]) -> list[int]:
        """Checksums of ``pages`` as the table keeps them (int64), computed with this store's
        algorithm; on a device in batches of consecutive pages (one copy back per batch)."""
        out: list[int] = []
        if not self.hashes_on_device:
            return [to_i64(checksum(self.pages[p], self.checksum_algorithm)) for p in pages]
        first = 0
        pages = list(pages)
        while first < len(pages):
            stop = first + 1
            while stop < len(pages) and pages[stop] == pages[stop - 1] + 1 and stop - first < _HASH_RUN:
                stop += 1
            out += page_hashes(self.pages[pages[first] : pages[stop - 1] + 1]).tolist()
            first = stop
        return out

    def tier2_parity(self, stripe: int) -> list[torch.Tensor]:
        """The H2 parity pages of tier-2 stripe ``stripe`` (the store must have tier 2)."""
        if self.parity2 is None:
            raise InternalError(f"rank {self.spec.rank}: tier-2 parity asked for, but this store has no tier 2")
        return list(self.parity2[stripe])

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
        return torch.nonzero(self.phases() != ChunkPhase.IDLE).flatten().tolist()


def _host_bytes(spec: StoreSpec) -> int:
    """What ``create`` will allocate in /dev/shm: every segment but those in device memory, and
    the node's tier-2 segment unless another rank created it already."""
    on_device = DEVICE_SEGMENTS if spec.config.backend == "cuda" else ()
    total = sum(n for what, n in spec.sizes().items() if what not in on_device) + spec.spec_bytes()
    if spec.tier2.enabled and not os.path.exists(os.path.join(SHM_DIR, spec.node_name("parity2"))):
        total += spec.parity2_bytes()
    return total


def _create_or_attach(name: str, nbytes: int) -> SharedSegment:
    """The node's tier-2 segment is shared by its ranks: the first one creates it."""
    try:
        return SharedSegment.create(name, nbytes)
    except FileExistsError:
        seg = SharedSegment.attach(name)
        if seg.nbytes != nbytes:
            seg.close()
            raise ConfigurationError(f"tier-2 segment {name} has {seg.nbytes} B, expected {nbytes} B: the node's "
                                     "ranks must share one layout (same model, optimizer and RetainedConfig)") from None
        return seg


def _with_device_manager(spec: StoreSpec, settings: ProcessSettings) -> StoreSpec:
    """backend="cuda": fail early and clearly without CUDA, and record (in the spec every
    attacher reads) which state manager holds the device memory."""
    from .backends import cuda_ipc

    cuda_ipc.require_cuda()
    if spec.device_manager:
        return spec
    address = cuda_ipc.manager_for_new_store(f"{spec.job_id}-r{spec.rank}", settings.cuda_manager,
                                             settings.manager_dir)
    return dataclasses.replace(spec, device_manager=address)


def _new_segment(spec: StoreSpec, what: str, nbytes: int):
    if spec.config.backend == "cuda" and what in DEVICE_SEGMENTS:
        from .backends.cuda_ipc import CudaSegment

        # on this process's device: where the model it binds trains (RetainedConfig.for_device)
        return CudaSegment.create(spec.name(what), nbytes, spec.device_manager, torch.cuda.current_device())
    return SharedSegment.create(spec.name(what), nbytes)


def _open_segment(spec: StoreSpec, what: str):
    if spec.config.backend == "cuda" and what in DEVICE_SEGMENTS:
        from .backends.cuda_ipc import CudaSegment

        return CudaSegment.attach(spec.name(what), spec.device_manager)
    return SharedSegment.attach(spec.name(what))


def _attach_or_missing(name: str, job_id: str, rank: int) -> SharedSegment:
    try:
        return SharedSegment.attach(name)
    except FileNotFoundError:
        raise StoreMissingError(
            f"rank {rank} of job {job_id}: retained segment {name} does not exist (never created: the failure came "
            "before set-up finished, or already freed). Start from the last checkpoint (or afresh).") from None
