"""The cross-node tier (``RetainedConfig.tier3_parity=1``): each rank's state on the next node.

For state no other node holds (plain FSDP2 shards), a lost node's ranks can only be rebuilt
from something the other nodes keep. Rank (node n, local rank l) keeps, in its ``parity3``
segment, a copy of rank (node n - 1 mod N, local rank l)'s ``data`` and ``meta`` segments as
they were when that rank *prepared* an iteration: a code over nodes with one data and one parity
unit (a mirror), double-buffered::

    header page: per slot s in (0, 1): [iteration, MAGIC]   | slot 0: data, meta | slot 1: ...

``NodeMirror.refresh(t)`` runs inside the chunk transaction between ``prepare(t)`` and the step's
agreement: invalidate slot ``t % 2``, send this rank's pages and metadata to the next node,
receive the previous node's into the slot, mark it with ``t``. No rank updates iteration ``t``
before every rank passed the agreement, so after a node loss the successor's newest marked copy
is ``prepared(t)`` -- the parameters and optimizer state of ``t - 1`` with the gradients of ``t``
-- or ``prepared(t - 1)``, and a spare rebuilt from it recovers like any rank: rolled forward
or aborted with the job (``updater.recovery``). Metadata travels with the pages: the progress
record (with the resume payload), step counters and page checksums of the lost rank.

Cost: twice the rank's data and metadata in host memory on the next node, and the rank's data
sent once per step (measured in ``benchmarks/tier3_cost.py``). It assumes every rank's store has
the same layout (FSDP2's padded shards: true) and host memory (``backend="cpu"``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import ConfigurationError
from ..retained.spec import PAGE
from ..retained.store import RetainedStore

MAGIC = 0x4C45544F54495233  # "LETOTIR3": a slot holding a complete copy


def slots(store: RetainedStore) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The ``parity3`` segment's header (int64 [2, 2]: iteration, magic per slot) and its two slots."""
    seg = store.segments["parity3"].tensor
    size = (seg.numel() - PAGE) // 2
    header = seg[: 4 * 8].view(torch.int64).view(2, 2)
    return header, [seg[PAGE + s * size : PAGE + (s + 1) * size] for s in (0, 1)]


def copy_parts(store: RetainedStore, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The data and meta bytes of a copy inside ``slot`` (sized like this store's own)."""
    data, meta = store.segments["data"].tensor.numel(), store.segments["meta"].tensor.numel()
    return slot[:data], slot[data : data + meta]


def newest_copy(store: RetainedStore) -> tuple[int, torch.Tensor] | None:
    """The iteration and bytes of the newest complete copy this store keeps of its predecessor's
    rank, or None (no step prepared yet, or tier 3 off)."""
    if "parity3" not in store.segments:
        return None
    header, parts = slots(store)
    marked = [(int(header[s, 0]), parts[s]) for s in (0, 1) if int(header[s, 1]) == MAGIC]
    return max(marked, key=lambda m: m[0], default=None)


class NodeMirror:
    """This rank's side of tier 3 (module doc); the process groups of same-local-rank ranks
    across nodes are made at the first refresh (every rank reaches it together)."""

    def __init__(self, store: RetainedStore) -> None:
        spec = store.spec
        world = dist.get_world_size()
        self.local, self.n_local = spec.local_rank, spec.n_local
        self.nodes = world // self.n_local
        if self.nodes < 2 or world % self.n_local:
            raise ConfigurationError(f"tier3_parity=1 copies each rank's state to the next node: it needs 2 or more "
                                     f"nodes of equal size (world size {world}, {self.n_local} ranks per node)")
        if spec.config.backend != "cpu":
            raise ConfigurationError("tier3_parity=1 copies host memory between nodes: it needs backend='cpu' for now")
        self.store, self.node = store, spec.node
        self._group: dist.ProcessGroup | None = None
        self._header, self._slots = slots(store)

    def _ring(self) -> dist.ProcessGroup:
        if self._group is None:
            for local in range(self.n_local):  # every rank makes every group, in the same order
                group = dist.new_group([n * self.n_local + local for n in range(self.nodes)])
                if local == self.local:
                    self._group = group
        assert self._group is not None
        return self._group

    def refresh(self, iteration: int) -> None:
        """Send this rank's prepared state to the next node, keep the previous node's."""
        group, slot = self._ring(), iteration % 2
        self._header[slot, 1] = 0  # a copy half received is never taken for a complete one
        data, meta = copy_parts(self.store, self._slots[slot])
        nxt = ((self.node + 1) % self.nodes) * self.n_local + self.local
        prev = ((self.node - 1) % self.nodes) * self.n_local + self.local
        works = [dist.isend(self.store.segments["data"].tensor, nxt, group=group, tag=0),
                 dist.isend(self.store.segments["meta"].tensor, nxt, group=group, tag=1),
                 dist.irecv(data, prev, group=group, tag=0), dist.irecv(meta, prev, group=group, tag=1)]
        for work in works:
            if work is not None:
                work.wait()
        self._header[slot, 0] = iteration
        self._header[slot, 1] = MAGIC


def mirror_for(store: RetainedStore) -> Callable[[int], None] | None:
    """The refresh a rank's chunk transactions call after each prepare, if tier 3 is on (the
    mirror is made at the first one: binding needs no process group)."""
    if not store.config.tier3_parity:
        return None
    made: list[NodeMirror] = []

    def refresh(iteration: int) -> None:
        if not made:
            made.append(NodeMirror(store))
        made[0].refresh(iteration)

    return refresh
