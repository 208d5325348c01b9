"""Moving a lost node's retained state to the spare that takes its place.

Two sources (``plan``), both *before* anyone repairs: the spare then recovers its stores with
the job like every node (restore, repair, roll forward or abort, ``updater.recovery``).

- **replica** -- under data parallelism every rank holds the same parameters, reduced gradients
  and optimizer state, under HSDP every replica group the same shards
  (``StoreSpec.replica_shards``): the first surviving node sends each of its ranks' segments
  (spec, data, undo, tier-1 parity, metadata with page checksums, step counters and progress
  record) and the node's tier-2 parity byte for byte, as they are; the spare's recovery does to
  them what the source's does to the originals, bit for bit.
- **mirror** -- state no other node holds, with the cross-node tier on (``tier3_parity=1``,
  ``updater/tier3.py``): the lost node's successor sends its newest complete copy of each lost
  rank's data and metadata (a prepared iteration) and its own spec (the same layout); the spare
  checks every page against the copy's checksums, re-encodes tier 1 and tier 2, and starts from
  that prepared iteration.

The bytes travel over a two-process gloo group of the source and the spare's agents
(``keys.TRANSFER``, a fresh rendezvous per transfer). That channel is torch's, unauthenticated;
what vouches for them is the source's signed ``TransferManifest``: every segment's size and
SHA-256. The spare writes the segments under its own job id with the lost ranks' identity
(rank, node) in the spec, opens the stores as a trainer would, marks them complete and ready
(``keys.STORE_READY``), and says so (``keys.TRANSFER_DONE``).

Refused (the reason goes to both sides; the job falls back to the checkpoint): state without a
replica and without the cross-node tier (plain FSDP2 or ZeRO-1), a source whose ranks hold
other shards than the lost ones, a lost node whose successor (its copy's holder) is lost too,
and retained state in device memory (``backend="cuda"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import LetoTimeoutError, RetainedStateError
from ..retained.spec import read_spec
from ..retained.store import RetainedStore, StoreSpec
from ..updater.repair import find_damage
from ..updater.store_setup import copy_in_store, encode_all, encode_tier2
from ..updater.tier3 import copy_parts, newest_copy
from ..updater.transaction import ParityCodes
from .control import SignedStore
from .keys import STORE_READY, TRANSFER, TRANSFER_DONE, TRANSFER_MANIFEST
from .messages import SegmentDigest, TransferManifest

RANK_SEGMENTS = ("spec", "data", "undo", "parity1", "meta")  # "spec" first: it sizes the others
REPLICA, MIRROR = "replica", "mirror"


@dataclass(frozen=True)
class TransferPlan:
    """Where a lost node's state comes from: ``mode`` from node ``source``, or why it cannot."""

    node: int
    mode: str | None
    source: int | None
    problem: str | None = None


def plan(spec: StoreSpec, node: int, lost: set[int], nnodes: int) -> TransferPlan:
    """From a surviving node's own spec (every node's stores share one configuration): the same
    answer on every survivor."""
    survivors = [n for n in range(nnodes) if n not in lost]
    if spec.config.backend != "cpu":
        return TransferPlan(node, None, None, f"rank {spec.rank}'s retained state is in device memory (backend "
                                              f"{spec.config.backend!r}): moving it to a spare is not supported yet")
    if spec.replica_shards:
        return TransferPlan(node, REPLICA, survivors[0])
    if spec.config.tier3_parity:
        holder = (node + 1) % nnodes
        if holder in lost:
            return TransferPlan(node, None, None, f"node {node}'s copy is on node {holder}, which is lost too")
        return TransferPlan(node, MIRROR, holder)
    return TransferPlan(node, None, None, f"rank {spec.rank} holds a shard of the training state (FSDP2 without "
                                          "replicas, or ZeRO-1) that no other node has: no replica, and the cross-"
                                          "node tier is off (RetainedConfig(tier3_parity=1))")


@dataclass(frozen=True)
class TransferReport:
    """One side of one transfer: how much moved, how long it took, what was verified."""

    node: int  # the slot being replaced
    source: int  # the node slot that sent
    nbytes: int
    seconds: float
    pages_verified: int = 0  # the receiver: pages checked against the checksums that came with them
    problem: str | None = None


def send_node_state(store: SignedStore, job_id: str, ranks: list[int], how: TransferPlan, generation: int,
                    timeout: timedelta) -> TransferReport:
    """The source side: this node's stores (``ranks``; their copies of the lost node's, for a
    mirror) to the spare of ``how.node``. A plan without a source says why on its behalf."""
    t0 = time.time()
    node, source = how.node, how.source if how.source is not None else -1
    stores: dict[int, RetainedStore] = {}
    try:
        problem = how.problem
        if problem is None:
            for local, rank in enumerate(ranks):
                stores[local] = RetainedStore.attach(job_id, rank)
            problem = _not_transferable(stores, source, node) if how.mode == REPLICA else _no_copy(stores)
        segments = [] if problem else (_segments(stores) if how.mode == REPLICA else _copies(stores))
        manifest = TransferManifest(source, tuple(SegmentDigest(name, t.numel(), _sha256(t)) for name, t in segments),
                                    problem, how.mode)
        store.set(TRANSFER_MANIFEST.format(gen=generation, node=node), manifest.to_json())
        if problem is None:
            channel = _channel(store.raw, generation, node, 0, timeout)
            for tag, (_, tensor) in enumerate(segments):
                channel.send([tensor], 1, tag).wait()
            done = _await(store, TRANSFER_DONE.format(gen=generation, node=node), timeout)
            problem = json.loads(done).get("problem")
        return TransferReport(node, source, sum(t.numel() for _, t in segments), time.time() - t0, problem=problem)
    finally:
        for s in stores.values():
            s.close()


def receive_node_state(store: SignedStore, job_id: str, ranks: list[int], node: int, generation: int,
                       timeout: timedelta) -> TransferReport:
    """The spare side: the stores of ``node``'s ``ranks`` under ``job_id``, complete and marked
    ready; or the report's ``problem`` (nothing received is left behind)."""
    t0 = time.time()
    try:
        manifest = TransferManifest.from_json(_await(store, TRANSFER_MANIFEST.format(gen=generation, node=node),
                                                     timeout))
    except LetoTimeoutError:
        return TransferReport(node, -1, 0, time.time() - t0, problem=f"no node sent node {node}'s state within "
                                                                     f"{timeout} (the survivors could not use theirs)")
    nbytes = sum(d.nbytes for d in manifest.segments)
    problem, pages = manifest.problem, 0
    if problem is None:
        try:
            pages = _receive(store, manifest, job_id, ranks, node, generation, timeout)
        except RetainedStateError as exc:  # a digest or page mismatch, an unreadable spec
            problem = str(exc)
        store.set(TRANSFER_DONE.format(gen=generation, node=node), json.dumps({"problem": problem}))
    return TransferReport(node, manifest.source, nbytes, time.time() - t0, pages, problem)


class TransferError(RetainedStateError):
    """A received segment does not match what the source vouched for (reported as the
    transfer's problem)."""


def _receive(store: SignedStore, manifest: TransferManifest, job_id: str, ranks: list[int], node: int,
             generation: int, timeout: timedelta) -> int:
    channel = _channel(store.raw, generation, node, 1, timeout)
    received: dict[str, torch.Tensor] = {}
    for tag, digest in enumerate(manifest.segments):
        tensor = torch.empty(digest.nbytes, dtype=torch.uint8)
        channel.recv([tensor], 0, tag).wait()
        if _sha256(tensor) != digest.sha256:
            raise TransferError(f"segment {digest.name} from node {manifest.source} does not match its SHA-256 in the "
                                "signed manifest (changed on the way)")
        received[digest.name] = tensor
    created: list[RetainedStore] = []
    try:
        for local, rank in enumerate(ranks):
            created.append(_write_rank(received, local, job_id, rank, node))
        pages = _verify(created, strict=manifest.mode == MIRROR)
        if manifest.mode == MIRROR:
            _encode(created)
        for new in created:
            new.mark_complete()
            RetainedStore.attach(job_id, new.spec.rank).close()  # opens as a trainer will
            store.set(STORE_READY.format(job=job_id, rank=new.spec.rank), "1")
        return pages
    except BaseException:
        for new in created:
            new.unlink()
        raise
    finally:
        for new in created:
            new.close()


def _write_rank(received: dict[str, torch.Tensor], local: int, job_id: str, rank: int, node: int) -> RetainedStore:
    """The segments of the source's local rank ``local`` as rank ``rank``'s of slot ``node``
    (a mirror brings data and meta only: the rest is encoded again, ``_encode``)."""
    source_spec = read_spec(received[f"r{local}-spec"], f"r{local}-spec")[0]
    spec = dataclasses.replace(source_spec, job_id=job_id, rank=rank, node=node, device_manager="")
    contents = {what: received[f"r{local}-{what}"] for what in RANK_SEGMENTS[1:] if f"r{local}-{what}" in received}
    if local == 0 and spec.tier2.enabled and "parity2" in received:  # the node's: created with local rank 0's store
        contents["parity2"] = received["parity2"]
    return copy_in_store(spec, contents)


def _verify(stores: list[RetainedStore], strict: bool) -> int:
    """Pages whose checksum (as received) matches. A mirror's copy is a prepared iteration:
    every page, gradients included, must match. A replica comes as the source had it, chunks
    in flight and damage included: the spare's recovery restores and repairs it like the
    source's (and refuses what it cannot), so a mismatch here is counted, not refused; and its
    gradients count only where a roll-forward needs them (the recovery checks those)."""
    good = 0
    for new in stores:
        checked = new.layout.n_pages if strict else len(new.layout.update_pages)
        damaged = find_damage(new, include_grads=strict)
        if damaged and strict:
            raise TransferError(f"rank {new.spec.rank}: {len(damaged)} page(s) do not match the source's page "
                                f"checksums after the transfer (first: {damaged[:5]})")
        good += checked - len(damaged)
    return good


def _encode(stores: list[RetainedStore]) -> None:
    """Tier 1 of each rebuilt rank and tier 2 across them, from the received pages."""
    for new in stores:
        encode_all(new, ParityCodes(new))
    encode_tier2(stores, ParityCodes(stores[0]))


def _not_transferable(stores: dict[int, RetainedStore], source: int, node: int) -> str | None:
    """Why this node's stores cannot stand in for ``node``'s (local rank for local rank)."""
    for s in stores.values():
        spec = s.spec
        lost_rank = node * spec.n_local + spec.local_rank
        if lost_rank % spec.replica_shards != spec.rank % spec.replica_shards:
            return (f"rank {spec.rank} holds shard {spec.rank % spec.replica_shards} of {spec.replica_shards}, lost "
                    f"rank {lost_rank} shard {lost_rank % spec.replica_shards}: node {source} holds no replica of "
                    f"node {node}'s shards (lay out HSDP's replicate dimension across nodes)")
    return None


def _no_copy(stores: dict[int, RetainedStore]) -> str | None:
    iterations = {local: copy[0] if (copy := newest_copy(s)) else None for local, s in stores.items()}
    missing = [stores[local].spec.rank for local, it in iterations.items() if it is None]
    if missing:
        return f"rank(s) {missing} hold no complete copy of their predecessor's state yet (no step prepared)"
    return None


def _segments(stores: dict[int, RetainedStore]) -> list[tuple[str, torch.Tensor]]:
    out = [(f"r{local}-{what}", s.segments[what].tensor) for local, s in sorted(stores.items())
           for what in RANK_SEGMENTS]
    first = stores[0]
    if "parity2" in first.segments:
        out.append(("parity2", first.segments["parity2"].tensor))
    return out


def _copies(stores: dict[int, RetainedStore]) -> list[tuple[str, torch.Tensor]]:
    """Each local rank's spec (the layout the lost rank shared) and its newest copy of the
    lost rank's data and meta."""
    out: list[tuple[str, torch.Tensor]] = []
    for local, s in sorted(stores.items()):
        copy = newest_copy(s)
        assert copy is not None  # _no_copy refused otherwise
        data, meta = copy_parts(s, copy[1])
        out += [(f"r{local}-spec", s.segments["spec"].tensor), (f"r{local}-data", data), (f"r{local}-meta", meta)]
    return out


def _await(store: SignedStore, key: str, timeout: timedelta) -> bytes:
    store.wait([key], timeout)
    return store.get(key)


def _channel(raw: dist.Store, generation: int, node: int, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """The source (rank 0) and the spare (rank 1): a gloo group of their own, outside the
    default process group (an agent has none)."""
    prefix = dist.PrefixStore(TRANSFER.format(gen=generation, node=node), raw)
    group: dist.ProcessGroup = dist.ProcessGroupGloo(prefix, rank, 2, timeout)  # type: ignore[assignment]  # a backend
    return group


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().data).hexdigest()
