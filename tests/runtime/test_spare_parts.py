"""The parts of hot spares, each on real objects: a real TCPStore with signed values, real shared
memory, a real gloo pair between two threads (one process: no fresh interpreter per case).

- ``LaunchSpec``/``leto launch``: what ``--spares`` needs, refused with the fix;
- ``Membership``: a node whose agent stops beating is lost, a live one is not; a spare is
  claimed once per slot, never twice, never a dead one, and none when the pool is empty;
- the state transfer: a replica's stores arrive byte for byte under the lost rank's identity
  and open as a trainer opens them; damage the source's checksums do not vouch for, shards
  without a replica and a source with other shards are refused on both sides, leaving nothing.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from leto_lightning.errors import ConfigurationError
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import list_segments, new_job_id, unlink_segments
from leto_lightning.retained.store import RetainedStore, StoreSpec
from leto_lightning.runtime.control import SignedStore, host_store
from leto_lightning.runtime.keys import AGENT_BEAT, STORE_READY
from leto_lightning.runtime.membership import AgentBeat, Membership
from leto_lightning.runtime.spec import LaunchSpec
from leto_lightning.runtime.transfer import plan, receive_node_state, send_node_state
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.repair import find_damage
from leto_lightning.updater.retained_optimizer import RetainedOptimizer, config_for, layout_for
from leto_lightning.updater.store_setup import no_barrier, set_up_store
from leto_lightning.updater.tier3 import MAGIC, copy_parts, slots

SECRET = os.urandom(16).hex().encode()
CONFIG = RetainedConfig(page_bytes=4096, data_pages=4, tier1_parity=1, tier2_parity=1, record_bytes=1 << 14)
TIMEOUT = timedelta(seconds=30)


@pytest.fixture
def stores():
    """A hosted store and a way to open more signed connections to it (one per agent/thread)."""
    host, port = host_store("127.0.0.1", 0, TIMEOUT)
    opened = [host]

    def connect() -> SignedStore:
        raw = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=TIMEOUT,
                            wait_for_workers=False)
        opened.append(raw)
        return SignedStore(raw, SECRET)

    yield connect
    del opened[:]


# -- the launch --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, says", [
    ({"nnodes": 1, "spares": 1}, "node 0 hosts the job's store"),
    ({"nnodes": 2, "spares": -1}, "0 or more"),
    ({"nnodes": 2, "spares": 1, "node_rank": 3}, r"nnodes=2 \+ spares=1"),
    ({"nnodes": 2, "spares": 1, "external_store": True, "master_port": 1}, "one `leto launch` agent per node"),
])
def test_what_spares_need_is_refused_with_the_fix(kwargs, says):
    with pytest.raises(ConfigurationError, match=says):
        LaunchSpec("train.py", [], **kwargs)


def test_a_spare_has_no_ranks_until_it_takes_a_slot():
    spec = LaunchSpec("train.py", [], nproc_per_node=2, nnodes=2, node_rank=2, spares=1)
    assert spec.is_spare
    replacing = spec.taking_over(1)
    assert not replacing.is_spare and replacing.local_ranks == [2, 3] and replacing.repair_ranks == [2, 3]


# -- membership --------------------------------------------------------------------------------

def _membership(connect, node_rank: int, timeout: float = 0.5) -> Membership:
    spec = LaunchSpec("train.py", [], nnodes=2, node_rank=node_rank, spares=2)
    return Membership(connect(), spec, node_timeout=timeout, startup_timeout=timeout)


def test_a_node_whose_agent_stops_beating_is_lost(stores):
    beat = AgentBeat(stores(), launch=1, interval=0.05).start()
    watcher = _membership(stores, node_rank=0)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # beating: never lost
            assert watcher.lost() == []
            time.sleep(0.05)
    finally:
        beat.close()
    silent = time.monotonic()
    while watcher.lost() != [1]:  # the agent polls like this
        assert time.monotonic() - silent < 5.0, "a silent node was never found lost"
        time.sleep(0.05)
    assert time.monotonic() - silent >= 0.5  # not before the node timeout


def test_a_spare_is_claimed_once_per_slot_never_twice_never_dead(stores):
    beats = [AgentBeat(stores(), launch=spare, interval=0.05).start() for spare in (2, 3)]
    survivor, other = _membership(stores, 0), _membership(stores, 0)
    try:
        first = survivor.claim_spare(node=1, generation=4)
        assert first is not None and first.spare == 2
        assert other.claim_spare(node=1, generation=4) == first  # every survivor agrees
        assert survivor.holder(1) == 2
        assert survivor.claim_spare(node=1, generation=5).spare == 3  # spare 2 stays used
    finally:
        for beat in beats:
            beat.close()
    assert survivor.claim_spare(node=1, generation=6) is None  # the pool is empty


def test_a_spare_that_died_before_it_was_needed_is_not_claimed(stores):
    dead = AgentBeat(stores(), launch=2, interval=0.05).start()
    alive = AgentBeat(stores(), launch=3, interval=0.05).start()
    survivor = _membership(stores, 0)
    try:
        survivor.lost()  # first look at every agent
        dead.close()
        time.sleep(1.0)
        survivor.lost()
        assignment = survivor.claim_spare(node=1, generation=1)
        assert assignment is not None and assignment.spare == 3
    finally:
        alive.close()
    assert stores().read(AGENT_BEAT.format(launch=3)) is not None


# -- the state transfer ------------------------------------------------------------------------

@pytest.fixture
def jobs():
    """The source's and the spare's job ids; whatever either left in /dev/shm is freed, even
    when a store's set-up failed before the test could."""
    source_job, spare_job = new_job_id(), new_job_id()
    yield source_job, spare_job
    unlink_segments(source_job)
    unlink_segments(spare_job)


def _replicated_store(job_id: str, rank: int, node: int, local_rank: int, replica_shards: int = 1,
                      seed: int = 0, tier3: bool = False) -> RetainedOptimizer:
    """A rank's complete store after a few real AdamW steps (a DDP rank's when replica_shards=1)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = config_for(dataclasses.replace(CONFIG, tier3_parity=int(tier3)), opt)
    spec = StoreSpec(job_id, rank, node, local_rank, 1, layout_for(opt, config), config, replica_shards=replica_shards)

    def bind(store: RetainedStore) -> RetainedOptimizer:
        ro = RetainedOptimizer(opt, store, barrier=no_barrier)
        ro.bind(adopt=False)
        return ro

    ro = set_up_store(spec, bind, barrier=None, settings=None, attach_with="test")
    ro._mirror = None  # one process, no process group: tier 3's copy is made by hand below (_copy_of_itself)
    for _ in range(3):  # the last step's gradients stay, with their checksums: as at a prepare
        opt.zero_grad(set_to_none=False)
        model(torch.randn(4, 32)).square().sum().backward()
        ro.step()
    return ro


def _transfer(connect, source_job: str, spare_job: str) -> tuple:
    """Node 0 (rank 0) to the spare of lost node 1 (rank 1), as the survivors plan it."""
    reports: dict[str, object] = {}
    source = RetainedStore.attach(source_job, 0)
    how = plan(source.spec, node=1, lost={1}, nnodes=2)
    source.close()

    def send() -> None:
        reports["sent"] = send_node_state(connect(), source_job, [0], how, generation=1, timeout=TIMEOUT)

    sender = threading.Thread(target=send)
    sender.start()
    reports["received"] = receive_node_state(connect(), spare_job, [1], node=1, generation=1, timeout=TIMEOUT)
    sender.join(60)
    return reports["sent"], reports["received"]


def test_a_replica_arrives_byte_for_byte_as_the_lost_rank(stores, jobs):
    source_job, spare_job = jobs
    ro = _replicated_store(source_job, rank=0, node=0, local_rank=0)
    try:
        sent, received = _transfer(stores, source_job, spare_job)
        assert sent.problem is None and received.problem is None, (sent, received)
        assert received.nbytes == sent.nbytes > 0
        assert received.pages_verified == len(ro.store.layout.update_pages)  # all but the gradients
        copy = RetainedStore.attach(spare_job, 1)  # as a trainer of the spare opens it
        assert (copy.spec.rank, copy.spec.node, copy.spec.job_id) == (1, 1, spare_job) and copy.is_complete()
        assert torch.equal(copy.segments["data"].tensor, ro.store.segments["data"].tensor)
        assert torch.equal(copy.segments["meta"].tensor, ro.store.segments["meta"].tensor)
        copy.close()
        assert stores().read(STORE_READY.format(job=spare_job, rank=1)) is not None
    finally:
        ro.store.close()


def test_a_replica_comes_as_it_is_and_its_damage_is_left_to_the_spares_repair(stores, jobs):
    """Sent before anyone repairs: a damaged page arrives damaged (counted, not refused) and the
    spare's recovery repairs it from tier 1 like the source's."""
    source_job, spare_job = jobs
    ro = _replicated_store(source_job, rank=0, node=0, local_rank=0)
    try:
        ro.store.segments["data"].tensor[100] ^= 0xFF  # damage the page checksums do not vouch for
        sent, received = _transfer(stores, source_job, spare_job)
        assert sent.problem is None and received.problem is None
        assert received.pages_verified == len(ro.store.layout.update_pages) - 1
        copy = RetainedStore.attach(spare_job, 1)
        report = recover_node({0: copy})[0]
        assert report.repair.repaired == 1 and find_damage(copy, include_grads=False) == []
        copy.close()
    finally:
        ro.store.close()


def _copy_of_itself(store: RetainedStore, iteration: int) -> None:
    """Slot ``iteration % 2`` of the cross-node tier holding a copy of this very rank's pages and
    metadata, marked complete -- what ``NodeMirror.refresh`` leaves on the next node."""
    header, parts = slots(store)
    data, meta = copy_parts(store, parts[iteration % 2])
    data.copy_(store.segments["data"].tensor)
    meta.copy_(store.segments["meta"].tensor)
    header[iteration % 2, 0], header[iteration % 2, 1] = iteration, MAGIC


def test_a_cross_node_copy_is_rebuilt_and_re_encoded(stores, jobs):
    source_job, spare_job = jobs
    ro = _replicated_store(source_job, rank=0, node=0, local_rank=0, replica_shards=0, tier3=True)
    try:
        _copy_of_itself(ro.store, 3)
        sent, received = _transfer(stores, source_job, spare_job)
        assert sent.problem is None and received.problem is None, (sent, received)
        assert received.pages_verified == ro.store.layout.n_pages
        copy = RetainedStore.attach(spare_job, 1)
        assert torch.equal(copy.segments["data"].tensor, ro.store.segments["data"].tensor)
        assert torch.equal(copy.parity1, ro.store.parity1)  # tier 1 encoded again from the pages: the same
        copy.close()
    finally:
        ro.store.close()


def test_a_cross_node_copy_its_checksums_do_not_vouch_for_is_refused_and_nothing_is_left(stores, jobs):
    source_job, spare_job = jobs
    ro = _replicated_store(source_job, rank=0, node=0, local_rank=0, replica_shards=0, tier3=True)
    try:
        _copy_of_itself(ro.store, 3)
        _header, parts = slots(ro.store)
        parts[1][100] ^= 0xFF  # a page of the copy, not what its checksums say
        sent, received = _transfer(stores, source_job, spare_job)
        assert "do not match the source's page checksums" in received.problem
        assert sent.problem == received.problem  # the source learns why
        assert list_segments(f"leto-{spare_job}") == []
    finally:
        ro.store.close()


@pytest.mark.parametrize("replica_shards, says", [
    (0, "the cross-node tier is off"),  # plain FSDP2 / ZeRO-1: one rank's shard
    (2, "holds no replica of node 1's shards"),  # rank 0 holds shard 0 of 2, lost rank 1 shard 1
])
def test_state_without_a_replica_on_the_source_is_refused(stores, jobs, replica_shards, says):
    source_job, spare_job = jobs
    ro = _replicated_store(source_job, rank=0, node=0, local_rank=0, replica_shards=replica_shards)
    try:
        sent, received = _transfer(stores, source_job, spare_job)
        assert says in sent.problem and received.problem == sent.problem
        assert list_segments(f"leto-{spare_job}") == []
    finally:
        ro.store.close()
