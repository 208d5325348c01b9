"""ZeRO-1 (DDP + ZeroRedundancyOptimizer) with retained state, 2 gloo ranks on CPU, forked ranks.

- fault-free: bit-identical to DDP + ZeroRedundancyOptimizer(AdamW) and to DDP + AdamW (params,
  the owned AdamW state, losses), with accumulation, clipping and an LR schedule;
- an owner SIGKILLed between its commit and ZeRO's broadcast (its peer's replicas of the
  owner's params are stale): the stores rolled forward by ``recover_node`` in another process,
  new trainers refresh every replica from the owners' retained params, and continue
  bit-identically;
- (slow) a rank killed as an update begins and every data page of its store overwritten (its AdamW
  state has no other copy, and the peer's replicas of its params are not retained): rebuilt from
  the node's tier-2 parity across the two ranks' unequal shares (one page map, ``retained.owned``);
- the refusals: ``parameters_as_bucket_view=True``, ``overlap_with_ddp=True``.
"""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from leto_lightning import new_job_id
from leto_lightning.errors import ConfigurationError, UsageError
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.layout import GRAD
from leto_lightning.retained.owned import owned_layout
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.retained.spec import StoreSpec
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import run_in_child
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.zero1 import COMMITTED_POINT, create_zero1

from .zero1_job import ACCUMULATE, CONFIG, STEPS, WORLD, Job, errors, run_ranks

CHUNKS = 2  # per rank and iteration: the widest share (rank 0's 30-element weight) in 16-element chunks


def run_job(directory, name: str, kinds: tuple[str, ...] = ("retained",), **kw) -> dict[str, list[dict]]:
    """Run ``kinds`` one after the other in the same forked ranks; kind -> per-rank results."""
    out = directory / name
    out.mkdir()
    codes = run_ranks(Job(rendezvous=str(directory / f"{name}.rdzv"), out_dir=str(out), kinds=kinds, **kw))
    assert codes == dict.fromkeys(range(WORLD), 0), f"{name}: rank exit codes {codes}\n{errors(str(out))}"
    return {kind: [torch.load(out / f"r{r}-{kind}.pt") for r in range(WORLD)] for kind in kinds}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> dict[str, list[dict]]:
    """DDP + ZeroRedundancyOptimizer(AdamW), DDP + AdamW and retained ZeRO-1, and both ZeRO-1 kinds
    with two param groups, in the same ranks (each retained run its own job)."""
    job_id = new_job_id()
    try:
        return run_job(tmp_path_factory.mktemp("zero1"), "fault-free",
                       ("zero", "adamw", "retained", "zero+groups", "retained+groups"), job_id=job_id)
    finally:
        unlink_segments(job_id)
        unlink_segments(job_id + "g")


@pytest.fixture(scope="module")
def plain_zero(fault_free) -> list[dict]:
    return fault_free["zero"]


def assert_same(expected: list[dict], got: list[dict], what: str, state: bool = True) -> None:
    for rank in range(WORLD):
        exp, res = expected[rank], got[rank]
        for name, value in exp["params"].items():
            assert torch.equal(value, res["params"][name]), f"{what}: rank {rank} param {name}"
        if state:
            assert exp["state"].keys() == res["state"].keys(), f"{what}: rank {rank} owns other params"
            for name, st in exp["state"].items():
                for key, value in st.items():
                    assert torch.equal(value, res["state"][name][key]), f"{what}: rank {rank} {name}.{key}"


def test_fault_free_bit_identical_to_zero_and_to_adamw(fault_free, plain_zero):
    retained, adamw = fault_free["retained"], fault_free["adamw"]
    assert_same(plain_zero, retained, "retained ZeRO-1 vs ZeRO-1")
    assert_same(plain_zero, adamw, "ZeRO-1 vs DDP + AdamW", state=False)
    for rank in range(WORLD):
        assert all(torch.equal(x, y) for x, y in zip(plain_zero[rank]["losses"], retained[rank]["losses"], strict=True))
        assert all(torch.equal(x, y) for x, y in zip(adamw[rank]["losses"], retained[rank]["losses"], strict=True))
        # each rank's store holds exactly the params it owns; the partition is whole params, unequal
        assert retained[rank]["in_store"] and retained[rank]["replicas_outside"], f"rank {rank}"
        assert set(retained[rank]["versions"]) == {STEPS}
        for name, st in adamw[rank]["state"].items():  # the owned AdamW state is DDP + AdamW's
            if name in retained[rank]["state"]:
                assert all(torch.equal(v, retained[rank]["state"][name][k]) for k, v in st.items()), name
    assert sorted(retained[0]["state"]) == ["0.weight"]
    assert sorted(retained[1]["state"]) == ["0.bias", "2.bias", "2.weight"]


def test_two_param_groups_bit_identical(fault_free):
    """Weights with weight decay, biases without: rank 0 owns no bias (an empty segment in its
    store, sized for rank 1's share so tier 2 lines up)."""
    assert_same(fault_free["zero+groups"], fault_free["retained+groups"], "two param groups")
    retained = fault_free["retained+groups"]
    assert sorted(retained[0]["state"]) == ["0.weight"] and retained[0]["in_store"]
    assert sorted(retained[1]["state"]) == ["0.bias", "2.bias", "2.weight"] and retained[1]["in_store"]
    for rank in range(WORLD):
        assert all(torch.equal(x, y) for x, y in zip(fault_free["zero+groups"][rank]["losses"],
                                                     retained[rank]["losses"], strict=True)), f"rank {rank}"


def _recover(job_id: str, wipe_rank: int = -1) -> list[tuple[int, str, int, list[int]]]:
    """``recover_node`` over the node's stores (after overwriting every data page of
    ``wipe_rank``); per rank: status found, committed iteration, pages tier 2 rebuilt."""
    stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
    try:
        if wipe_rank >= 0:
            stores[wipe_rank].pages.fill_(0x5A)
        return [(r.rank, str(r.status_found), r.committed_iteration,
                 sorted(r.repair.tier2.get(r.rank, [])) if r.repair is not None else [])
                for r in recover_node(stores).values()]
    finally:
        for store in stores.values():
            store.close()


@pytest.mark.parametrize(("iteration", "kills"), [
    (1, ((0, COMMITTED_POINT, 2),)),  # rank 0 committed iteration 1; rank 1's copy of its weight is stale
    # both ranks in iteration 2: rank 1 after its commit, rank 0 in the middle of its first chunk
    pytest.param(2, ((1, COMMITTED_POINT, 3), (0, "chunk.math_done", 2 * CHUNKS + 1)), marks=pytest.mark.slow),
], ids=["owner-committed-not-broadcast", "both-ranks"])
def test_owner_killed_before_broadcast_recovers_from_owners(tmp_path, plain_zero, iteration, kills):
    job_id = new_job_id()
    try:
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        codes = run_ranks(Job(rendezvous=str(tmp_path / "crashed.rdzv"), out_dir=str(crashed), kinds=("retained",),
                              job_id=job_id, kills=kills))
        assert codes[kills[0][0]] == -signal.SIGKILL and 0 not in codes.values(), f"{codes}\n{errors(str(crashed))}"
        recovery = run_in_child(lambda: _recover(job_id), timeout=60)
        assert recovery.exit_code == 0, recovery
        assert {committed for _, _, committed, _ in recovery.value} == {iteration}, recovery.value
        continued = run_job(tmp_path, "continued", job_id=job_id, attach=True)["retained"]
    finally:
        unlink_segments(job_id)
    assert_same(plain_zero, continued, f"killed at {kills}")
    for rank in range(WORLD):
        tail = plain_zero[rank]["losses"][(iteration + 1) * ACCUMULATE:]
        assert all(torch.equal(x, y) for x, y in zip(tail, continued[rank]["losses"], strict=True)), f"rank {rank}"
        assert set(continued[rank]["versions"]) == {STEPS}


@pytest.mark.slow  # CI time: the layout that makes tier 2 line up is checked in CI (test_owned_layout_...)
def test_rank_store_overwritten_rebuilt_from_tier2(tmp_path, plain_zero):
    job_id = new_job_id()
    iteration = 2
    try:
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        codes = run_ranks(Job(rendezvous=str(tmp_path / "crashed.rdzv"), out_dir=str(crashed), kinds=("retained",),
                              job_id=job_id, kills=((1, "prepare.begin", iteration + 1),)))
        assert codes[1] == -signal.SIGKILL, f"{codes}\n{errors(str(crashed))}"
        recovery = run_in_child(lambda: _recover(job_id, wipe_rank=1), timeout=60)
        assert recovery.exit_code == 0, recovery
        found = {rank: (committed, tier2) for rank, _, committed, tier2 in recovery.value}
        assert found[0][0] == found[1][0] == iteration - 1, found
        store = RetainedStore.attach(job_id, 1)
        try:
            pages = [p for p, kind in enumerate(store.layout.page_kind) if kind != GRAD]
        finally:
            store.close()
        assert found[1][1] and set(found[1][1]) <= set(pages), f"tier 2 rebuilt {found[1][1]} of {pages}"
        continued = run_job(tmp_path, "continued", job_id=job_id, attach=True)["retained"]
    finally:
        unlink_segments(job_id)
    assert_same(plain_zero, continued, "rank 1's store rebuilt from tier 2")


def test_owned_layout_one_page_map_per_node():
    """Unequal shares (and a rank owning nothing in a group) still give every rank the same
    regions, so the node's tier-2 stripes line up; the slots are each rank's own."""
    owned = [[[("w", (5, 6))], [("b", (5,))]], [[("v", (3, 5)), ("c", (3,))], []]]
    options = [{"amsgrad": False}, {"amsgrad": False}]
    layouts = [owned_layout(owned, r, dtype=torch.float32, family="adam", group_options=options, page_bytes=64)
               for r in range(WORLD)]
    assert layouts[0].regions == layouts[1].regions and layouts[0].n_pages == layouts[1].n_pages
    assert [s.name for s in layouts[0].params] == ["w", "b"] and [s.name for s in layouts[1].params] == ["v", "c"]
    assert [s.numel for s in layouts[1].segments] == [18, 0]  # rank 1's share; the region fits rank 0's 30
    specs = [StoreSpec("j", r, 0, r, WORLD, layouts[r], CONFIG.for_device("cpu")) for r in range(WORLD)]
    assert (specs[0].tier2.page_stripe == specs[1].tier2.page_stripe).all()
    assert specs[0].parity2_bytes() == specs[1].parity2_bytes()


def test_refusals_name_the_value_and_the_fix(tmp_path):
    """Each refusal names the value and the fix, before anything is allocated (no segment)."""
    result = run_in_child(lambda: _refusals(str(tmp_path / "rdzv")), timeout=60)
    assert result.exit_code == 0, result
    found = result.value
    bucket, overlap = found["parameters_as_bucket_view"], found["overlap_with_ddp"]
    assert "parameters_as_bucket_view=True" in bucket and "parameters_as_bucket_view=False" in bucket, bucket
    assert "overlap_with_ddp=True" in overlap and "overlap_with_ddp=False" in overlap, overlap
    assert "Adagrad" in found["adagrad"] and "SGD, Adam and AdamW" in found["adagrad"], found["adagrad"]
    assert "before its first step" in found["stepped"], found["stepped"]
    assert "manual optimization" in found["lightning manual"] and "automatic_optimization=True" in found[
        "lightning manual"], found
    assert "rollback_window=False" in found["accelerate rollback"], found


def _refusals(rendezvous: str) -> dict[str, str]:
    from leto_lightning.integrations.accelerate import zero1 as accelerate_zero1
    from leto_lightning.integrations.lightning.zero1 import zero1_partition

    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 1), rank=0, world_size=1)
    net = torch.nn.Linear(3, 2)

    def message(fn, expected: type[Exception] = ConfigurationError) -> str:
        with pytest.raises(expected) as info:
            fn()
        return str(info.value)

    try:
        found = {}
        for flag in ("parameters_as_bucket_view", "overlap_with_ddp"):
            zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, **{flag: True})
            found[flag] = message(lambda: create_zero1(zero, RetainedConfig(), job_id=new_job_id()))
        adagrad = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adagrad)
        found["adagrad"] = message(lambda: create_zero1(adagrad, RetainedConfig(), job_id=new_job_id()))
        stepped = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW)
        net(torch.ones(1, 3)).sum().backward()
        stepped.step()
        found["stepped"] = message(lambda: create_zero1(stepped, RetainedConfig(), job_id=new_job_id()), UsageError)
        zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW)
        found["lightning manual"] = message(lambda: zero1_partition(zero, net, manual=True))
        found["accelerate rollback"] = message(lambda: accelerate_zero1.bind(
            zero, RetainedConfig(), new_job_id(), {}, False, None, lambda: None, {}, under_launcher=False,
            rollback_window=True))
        return found
    finally:
        dist.destroy_process_group()
