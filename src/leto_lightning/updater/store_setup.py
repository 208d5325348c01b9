"""Setting up a new retained store: the one routine every binding goes through.

Whoever creates a store -- plain PyTorch's session, both Lightning strategies,
``LetoAccelerator``, the FSDP2 and ZeRO-1 bindings, ``RetainedOptimizer.create``, the test
scenarios -- does the same four things in the same order, here:

1. **create** the rank's segments (``RetainedStore.create``), refused before any segment exists
   when tier 2 would need a barrier the caller lacks, or the store exists already;
2. **bind** the optimizer's parameters, gradients and state to views into it, copying the
   current values in and encoding tier-1 parity (the caller's ``bind``: its binding family);
3. **encode tier 2** across the node's ranks (local rank 0, between two barriers);
4. **mark it complete**: from here on recovery may trust it.

Steps 3 and 4 (``complete_new_store``) may be deferred (``complete=False``) by a caller that
must first let something else write the bound values -- Lightning's DDP wrap broadcasts rank 0's
parameters into the views -- and then re-encodes (``encode_all``) and completes. A store loaded
again from a checkpoint (``reinitialise``) completes the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from ..env import ProcessSettings
from ..errors import UsageError
from ..faults.points import point
from ..retained.layout import GRAD
from ..retained.store import RetainedStore, StoreSpec
from .transaction import ParityCodes

Bound = TypeVar("Bound")


def set_up_store(spec: StoreSpec, bind: Callable[[RetainedStore], Bound], *, barrier: Callable[[], None] | None,
                 settings: ProcessSettings | None, attach_with: str, complete: bool = True,
                 unlink_on_error: bool = False) -> Bound:
    """This rank's new store for ``spec``, bound by ``bind`` (which copies the values in and
    encodes tier 1: ``bind(adopt=False)`` of its binding), then tier 2 and the completion mark
    unless ``complete=False`` (module doc). ``attach_with`` says how to continue from a store
    that exists already. ``unlink_on_error``: a failed bind removes the new segments (nothing
    else will attach to them); otherwise they stay for the agent to report as incomplete."""
    store = create_node_store(spec, barrier, attach_with, settings)
    point("setup.segments_created")  # segments exist, not yet initialised: where OOM kills land
    try:
        bound = bind(store)
    except BaseException:
        if unlink_on_error:
            store.unlink()
            store.close()
        raise
    if complete:
        complete_new_store(store, barrier)
    return bound


def encode_all(store: RetainedStore, codes: ParityCodes) -> None:
    """Checksum every page, encode all tier-1 parity from scratch and checksum and mirror all
    metadata (a new store). Withdraws the completion mark: the creator writes it again once
    tier 2 is encoded too (``RetainedStore.mark_complete``)."""
    from ..retained.integrity import Metadata
    from .device_pages import DevicePages  # the device path only

    store.clear_complete()
    lay, plan = store.layout, store.spec.tier1
    if store.hashes_on_device:  # parity and checksums computed where the pages are, chunk by chunk
        device = DevicePages(store, codes.tier1)
        for chunk in range(lay.n_chunks):
            updated = lay.chunk_pages_updated(chunk)
            store.crcs[updated] = torch.from_numpy(device.refresh(updated))
        for seg in lay.segments:
            if GRAD in seg.kinds:
                r = lay.region(seg.index, GRAD)
                store.crcs[r.first_page : r.first_page + r.n_pages] = torch.from_numpy(
                    device.refresh_run(r.first_page, r.first_page + r.n_pages, plan.data_pages))
    else:
        store.crcs[:] = torch.tensor(store.page_checksums(range(lay.n_pages)), dtype=torch.int64)
        if codes.tier1 is not None:
            for g, members in enumerate(plan.groups):
                codes.tier1.encode([store.pages[p] for p in members], list(store.parity1[g]))
    Metadata(store).seal_all()


def encode_tier2(stores: Sequence[RetainedStore], codes: ParityCodes) -> None:
    """Encode the node's tier-2 stripes from every local rank's pages (after all are bound).
    The last step of set-up: each rank then calls ``store.mark_complete()``."""
    if codes.tier2 is None:
        return
    first = stores[0]
    for p, s in enumerate(first.spec.tier2.page_stripe):
        if s >= 0:
            codes.tier2.encode([st.pages[p] for st in stores], first.tier2_parity(int(s)))


def create_node_store(spec: StoreSpec, barrier: Callable[[], None] | None, attach_with: str,
                      settings: ProcessSettings | None = None) -> RetainedStore:
    """This rank's new store for ``spec`` (``RetainedStore.create(spec, settings)``), refused
    before any segment exists when tier 2 would need a ``barrier`` it lacks or the store exists
    already (``attach_with`` names the call that continues from it)."""
    if spec.tier2.enabled and barrier is None:
        raise UsageError(f"tier 2 across {spec.n_local} local ranks needs a barrier over the node's ranks")
    try:
        return RetainedStore.create(spec, settings)
    except FileExistsError:
        raise UsageError(f"retained memory of job {spec.job_id!r} rank {spec.rank} already exists: continue from it "
                         f"({attach_with}), or free it (`leto cleanup`) to start over") from None


def copy_in_store(spec: StoreSpec, contents: Mapping[str, torch.Tensor]) -> RetainedStore:
    """A store whose segments arrive whole from elsewhere (a replica's, ``runtime/transfer.py``):
    created like any other (one process creates every store of the node: no barrier), each
    segment named in ``contents`` filled byte for byte. Not complete until the caller verified
    it and marks it (``RetainedStore.mark_complete``)."""
    store = create_node_store(spec, no_barrier, attach_with="a state transfer")
    try:
        for what, tensor in contents.items():
            store.segments[what].tensor.copy_(tensor)
    except BaseException:
        store.unlink()
        store.close()
        raise
    return store


def encode_node_tier2(store: RetainedStore, barrier: Callable[[], None] | None) -> None:
    """Tier 2 spans the node's ranks: once every local rank's pages hold their values (all
    bound), local rank 0 encodes the stripes from all of them; each rank keeps them current by
    deltas afterwards. Every local rank calls this; ``barrier`` spans the node's ranks."""
    spec = store.spec
    if not spec.tier2.enabled:
        return
    if barrier is None:
        if spec.n_local > 1:
            raise UsageError(f"tier 2 across {spec.n_local} local ranks needs a barrier over the node's ranks")
        barrier = no_barrier
    barrier()
    if spec.local_rank == 0:
        first = spec.rank - spec.local_rank
        peers = [RetainedStore.attach(spec.job_id, first + i) for i in range(1, spec.n_local)]
        try:
            encode_tier2([store, *peers], ParityCodes(store))
        finally:
            for peer in peers:
                peer.close()
    barrier()


def complete_new_store(store: RetainedStore, barrier: Callable[[], None] | None) -> None:
    """The last step of every new store's set-up, whoever creates it (plain PyTorch, the
    Lightning strategies, LetoAccelerator, FSDP2, ZeRO-1, a reload): once its views are bound
    and its tier-1 parity encoded, tier 2 across the node's ranks, then the completion mark --
    from here on recovery may trust it. Every local rank calls it; ``barrier`` spans them."""
    encode_node_tier2(store, barrier)
    store.mark_complete()


def no_barrier() -> None:
    """One local rank: nothing to wait for."""
