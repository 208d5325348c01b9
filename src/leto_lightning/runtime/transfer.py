"""Moving a lost node's retained state to the spare that takes its place, from a replica.

Under data parallelism every rank holds the same parameters, reduced gradients and optimizer
state, and under HSDP every replica group the same shards (``StoreSpec.replica_shards``), so
the lost node's ranks are rebuilt from the same local ranks of a surviving node that holds the
same shards, *after* that node repaired and rolled its stores forward (they are
at the job's resume iteration, as every other node's). The source sends each of its ranks'
segments -- spec, data, undo, tier-1 parity, metadata (page checksums, step counters, the
progress record) -- and the node's tier-2 parity, byte for byte, over a two-process gloo group
of the source and the spare's agents (``keys.TRANSFER``: a fresh rendezvous per transfer).

That channel is torch's, unauthenticated; what vouches for the bytes is the source's signed
``TransferManifest`` (the job's control plane): every segment's size and SHA-256. The spare
checks each digest, writes the segments under its own job id with the lost ranks' identity
(rank, node) in the spec, verifies every page against the source's page checksums, attaches
the stores as a trainer would, marks them complete and ready (``keys.STORE_READY``), and says
so (``keys.TRANSFER_DONE``). Its trainers then attach exactly as after an in-place recovery.

Refused (the reason goes to both sides; the job falls back to the checkpoint): state that is
not replicated (plain FSDP2 or ZeRO-1 shards exist on one rank only), a source whose ranks hold
other shards than the lost ones, and retained state in device memory (``backend="cuda"``).
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

from ..errors import RetainedStateError
from ..retained.spec import read_spec
from ..retained.store import RetainedStore
from ..updater.repair import find_damage
from ..updater.store_setup import copy_in_store
from .control import SignedStore
from .keys import STORE_READY, TRANSFER, TRANSFER_DONE, TRANSFER_MANIFEST
from .messages import SegmentDigest, TransferManifest

RANK_SEGMENTS = ("spec", "data", "undo", "parity1", "meta")  # "spec" first: it sizes the others


@dataclass(frozen=True)
class TransferReport:
    """One side of one transfer: how much moved, how long it took, what was verified."""

    node: int  # the slot being replaced
    source: int  # the node slot that sent
    nbytes: int
    seconds: float
    pages_verified: int = 0  # the receiver: pages checked against the source's checksums
    problem: str | None = None


def send_node_state(store: SignedStore, job_id: str, ranks: list[int], source: int, node: int, generation: int,
                    timeout: timedelta) -> TransferReport:
    """The source side: this node's stores (``ranks``, repaired) to the spare of ``node``."""
    t0 = time.time()
    stores: dict[int, RetainedStore] = {}
    try:
        for local, rank in enumerate(ranks):
            stores[local] = RetainedStore.attach(job_id, rank)
        problem = _not_transferable(stores, source, node)
        segments = [] if problem else _segments(stores)
        manifest = TransferManifest(source, tuple(SegmentDigest(name, t.numel(), _sha256(t)) for name, t in segments),
                                    problem)
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
    """The spare side: the stores of ``node``'s ``ranks`` under ``job_id``, verified, complete
    and marked ready; or the report's ``problem`` (nothing usable was left behind)."""
    t0 = time.time()
    manifest = TransferManifest.from_json(_await(store, TRANSFER_MANIFEST.format(gen=generation, node=node), timeout))
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
        pages = 0
        for local, rank in enumerate(ranks):
            created.append(_write_rank(received, local, job_id, rank, node))
        for new in created:
            damaged = find_damage(new, include_grads=False)
            if damaged:
                raise TransferError(f"rank {new.spec.rank}: {len(damaged)} page(s) do not match the source's page "
                                    f"checksums after the transfer (first: {damaged[:5]})")
            pages += new.layout.n_pages
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
    """The segments of the source's local rank ``local`` as rank ``rank``'s of slot ``node``."""
    source_spec = read_spec(received[f"r{local}-spec"], f"r{local}-spec")[0]
    spec = dataclasses.replace(source_spec, job_id=job_id, rank=rank, node=node, device_manager="")
    contents = {what: received[f"r{local}-{what}"] for what in RANK_SEGMENTS[1:]}
    if local == 0 and spec.tier2.enabled:  # the node's segment: created with local rank 0's store
        contents["parity2"] = received["parity2"]
    return copy_in_store(spec, contents)


def _not_transferable(stores: dict[int, RetainedStore], source: int, node: int) -> str | None:
    """Why this node's stores cannot stand in for ``node``'s (local rank for local rank)."""
    for s in stores.values():
        spec = s.spec
        if spec.config.backend != "cpu":
            return (f"rank {spec.rank}'s retained state is in device memory (backend {spec.config.backend!r}): "
                    "moving it to a spare is not supported yet")
        if not spec.replica_shards:
            return (f"rank {spec.rank} holds a shard of the training state (FSDP2 without replicas, or ZeRO-1) that "
                    "no other node has: no replica to rebuild the lost node's ranks from")
        lost_rank = node * spec.n_local + spec.local_rank
        if lost_rank % spec.replica_shards != spec.rank % spec.replica_shards:
            return (f"rank {spec.rank} holds shard {spec.rank % spec.replica_shards} of {spec.replica_shards}, lost "
                    f"rank {lost_rank} shard {lost_rank % spec.replica_shards}: node {source} holds no replica of "
                    f"node {node}'s shards (lay out HSDP's replicate dimension across nodes)")
    return None


def _segments(stores: dict[int, RetainedStore]) -> list[tuple[str, torch.Tensor]]:
    out = [(f"r{local}-{what}", s.segments[what].tensor) for local, s in sorted(stores.items())
           for what in RANK_SEGMENTS]
    first = stores[0]
    if "parity2" in first.segments:
        out.append(("parity2", first.segments["parity2"].tensor))
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
