"""Distributed checkpoints of retained FSDP2 shards: ``torch.distributed.checkpoint`` saves from
the retained views and loads into them, a restart from them (new processes, new job ids, fresh
stores: no HOF) is bit-identical to the uninterrupted run, and the checkpoints interoperate with
plain FSDP2 + AdamW both ways. Two gloo ranks forked from this process, per phase.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from leto_lightning import new_job_id
from leto_lightning.errors import IncompleteStoreError, LetoError
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import unlink_segments
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import run_in_child
from leto_lightning.updater.fsdp2 import RetainedFSDP2, attach_fsdp2, create_fsdp2
from leto_lightning.updater.fsdp2_state import detached_copy
from leto_lightning.updater.recovery import recover_node
from leto_lightning.updater.repair import find_damage, verify_parity
from leto_lightning.updater.transaction import ParityCodes

from .conftest import run_job
from .fsdp2_dcp_job import RESTARTS, job_ids, restart, save
from .fsdp2_job import ACCUMULATE, STEPS, WORLD, Job, run_ranks
from .test_fsdp2_identity import assert_same_state

SAVED_AT = 2  # iterations before the checkpoint; the restart trains STEPS - SAVED_AT more


def _run(tmp_path, name: str, job: Job, target) -> list[dict]:
    codes = run_ranks(job, target=target)
    assert codes == dict.fromkeys(range(WORLD), 0), f"{name}: rank exit codes {codes}"
    return [torch.load(tmp_path / f"{name}_r{r}.pt") for r in range(WORLD)]


def _store_consistency(job_id: str) -> dict:
    """Both ranks' stores as recovery would see them: damaged pages (checksums), parity groups
    and tier-2 stripes that had to be re-encoded (none when the load re-initialised them)."""
    stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
    try:
        codes = ParityCodes(stores[0])
        groups, stripes = verify_parity(stores, codes.tier1, codes.tier2, include_grads=False)
        return {"damaged": {r: find_damage(s, include_grads=False) for r, s in stores.items()},
                "groups": groups, "stripes": stripes, "complete": [s.is_complete() for s in stores.values()]}
    finally:
        for store in stores.values():
            store.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Plain and bound runs to ``SAVED_AT``, each saved with ``dcp.save`` (and the bound one
    pickled per rank); what every rank ended with."""
    directory = tmp_path_factory.mktemp("fsdp2_dcp")
    job = Job(rendezvous=str(directory / "save.rdzv"), out_dir=str(directory), steps=SAVED_AT, job_id=new_job_id())
    try:
        return directory, _run(directory, "save", job, save)
    finally:
        for job_id in job_ids(job).values():
            unlink_segments(job_id)


def _restart_job(directory: Path, tmp_path: Path, **kw) -> Job:
    """New processes, new job ids (fresh stores) loading the checkpoints in ``directory``."""
    return Job(rendezvous=str(tmp_path / "restart.rdzv"), out_dir=str(directory), steps=SAVED_AT,
               job_id=new_job_id(), **kw)


def test_dcp_restart_bit_identical_and_interoperates_with_plain_fsdp2(tmp_path, plain_fsdp2, checkpoints):
    directory, saved = checkpoints
    job = _restart_job(directory, tmp_path)
    ids = job_ids(job)
    try:
        restarted = _run(directory, "restart", job, restart)
        bound = [name for name, kind, _ in RESTARTS if kind == "retained"]
        consistency = run_in_child(lambda: {name: _store_consistency(ids[name]) for name in bound}, timeout=60)
    finally:
        for job_id in ids.values():
            unlink_segments(job_id)

    # what was saved: the bound run equals the plain one at the checkpoint, read from retained views
    plain_at, bound_at = [r["plain"] for r in saved], [r["retained"] for r in saved]
    assert_same_state(plain_at, bound_at, f"bound vs plain at iteration {SAVED_AT}")
    assert all(b["in_store"] and b["iteration"] == SAVED_AT for b in bound_at)

    for name, kind, source in RESTARTS:
        runs = [r[name] for r in restarted]
        assert_same_state(plain_fsdp2, runs, f"{name}: restarted at {SAVED_AT} vs uninterrupted {STEPS}")
        for rank, (uninterrupted, run) in enumerate(zip(plain_fsdp2, runs)):
            tail = uninterrupted["losses"][SAVED_AT * ACCUMULATE:]
            assert len(run["losses"]) == len(tail) > 0
            assert all(torch.equal(x, y) for x, y in zip(tail, run["losses"])), f"{name}: rank {rank}: losses"
            if kind != "retained":
                continue
            loaded = run["loaded"]  # right after the load: the store initialised from the checkpoint
            assert loaded["complete"] and loaded["iteration"] == SAVED_AT, f"{name}: rank {rank}: {loaded}"
            status, iteration, payload = loaded["record"]
            assert (status, iteration) == ("committed", SAVED_AT - 1), f"{name}: rank {rank}: record {loaded}"
            assert payload == ({"from": str(directory / source)} if name == "bound_from_bound" else None)
            assert loaded["in_store"] and loaded["padding_zero"] and loaded["groups_hold_params"]
            assert set(loaded["versions"]) == {SAVED_AT}
            assert run["in_store"] and run["padding_zero"] and run["iteration"] == STEPS
            assert set(run["versions"]) == {STEPS}
    assert consistency.exit_code == 0, consistency
    assert isinstance(consistency.value, dict) and set(consistency.value) == set(bound), consistency
    for name, check in consistency.value.items():
        assert check == {"damaged": {0: [], 1: []}, "groups": {}, "stripes": [], "complete": [True, True]}, (
            f"{name}: the store after the load and {STEPS - SAVED_AT} steps: {check}")


def _recover_refused(job_id: str) -> tuple[list[bool], str]:
    stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
    complete = [s.is_complete() for s in stores.values()]
    try:
        recover_node(stores)
        return complete, "recovered"
    except IncompleteStoreError as exc:
        return complete, f"IncompleteStoreError: {exc}"
    finally:
        for store in stores.values():
            store.close()


def test_rank_killed_while_loading_a_checkpoint_leaves_incomplete_stores(tmp_path, checkpoints):
    """Rank 1 SIGKILLed once the checkpoint is in its retained views but before they are
    protected again (rank 0 then killed as it waits): both stores stay incomplete, and recovery
    refuses them (resume from the checkpoint again) instead of repairing the loaded pages back
    to the new stores' initial values."""
    job = _restart_job(checkpoints[0], tmp_path, kills=((1, "restore.loaded", 1),))
    ids = job_ids(job)
    try:
        codes = run_ranks(job, target=restart)
        assert codes[1] == -signal.SIGKILL, f"rank 1 was not killed while loading: exit codes {codes}"
        verdict = run_in_child(lambda: _recover_refused(ids[RESTARTS[0][0]]), timeout=60)
    finally:
        for job_id in ids.values():
            unlink_segments(job_id)
    assert verdict.exit_code == 0, verdict
    complete, refusal = verdict.value
    assert complete == [False, False], f"stores marked complete while loading: {complete}"
    assert refusal.startswith("IncompleteStoreError: rank 0") and "last checkpoint" in refusal, refusal


class OneRank:
    """A one-rank gloo group (a HashStore: no port) in a forked child, and the stores bound in
    it (freed on exit)."""

    config = RetainedConfig(page_bytes=64, tier2_parity=0)

    def __enter__(self) -> OneRank:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.job_ids: list[str] = []
        return self

    def __exit__(self, *exc: object) -> None:
        for job_id in self.job_ids:
            unlink_segments(job_id)
        dist.destroy_process_group()

    def model(self, optimizer_of=torch.optim.AdamW) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        for module in (model[0], model):
            fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
        return model, optimizer_of(model.parameters())

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> RetainedFSDP2:
        self.job_ids.append(new_job_id())
        return create_fsdp2(model, optimizer, self.config, job_id=self.job_ids[-1], rank=0)


def _attempt(out: dict, what: str, load: Callable[[], object], store: RetainedStore) -> None:
    """``out[what]``: "accepted" or the refusal; ``out[what + " complete"]``: the store's mark after."""
    try:
        load()
        out[what] = "accepted"
    except LetoError as exc:
        out[what] = f"{type(exc).__name__}: {exc}"
    out[f"{what} complete"] = store.is_complete()


def _refusals() -> dict:
    out: dict = {}
    with OneRank() as one:
        model, optimizer = one.model()
        bound = one.bind(model, optimizer)
        job_id = one.job_ids[-1]
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        wrong = optimizer.state_dict()  # its per-param dicts are the optimizer's own (as in torch): copied
        wrong["state"] = {pid: dict(values) for pid, values in wrong["state"].items()}
        wrong["state"][0]["exp_avg"] = torch.zeros(5, 3)  # a full-size plain tensor, not this rank's shard
        _attempt(out, "optimizer", lambda: optimizer.load_state_dict(wrong), bound.store)
        _attempt(out, "negative", lambda: bound.load_state_dict(bound.state_dict(copy=True), iteration=-1),
                 bound.store)
        other, other_optimizer = one.model()  # the store is incomplete now: nothing to attach to
        _attempt(out, "attach", lambda: attach_fsdp2(other, other_optimizer, job_id=job_id, rank=0), bound.store)
        _attempt(out, "create", lambda: create_fsdp2(other, other_optimizer, one.config, job_id=job_id, rank=0),
                 bound.store)
        out["groups kept"] = [p for g in other_optimizer.param_groups for p in g["params"]] == list(other.parameters())
        _attempt(out, "good", lambda: bound.load_state_dict(bound.state_dict(copy=True), iteration=7), bound.store)
        out["iteration"] = bound.iteration
        _shadow_and_assign(out, one, model, bound)
        # detached (copied out of retained memory): loads go to the copies, restoring is refused
        kept, kept_optimizer = one.model()
        bound = one.bind(kept, kept_optimizer)
        saved = bound.state_dict(copy=True)
        bound.detach()
        _attempt(out, "detached", lambda: bound.load_state_dict(saved), bound.store)
        kept.load_state_dict(saved["model"])  # no hook left: the store is not touched
        kept_optimizer.load_state_dict(kept_optimizer.state_dict())
        out["detached kept"] = "load_state_dict" not in kept_optimizer.__dict__
    return out


def _shadow_and_assign(out: dict, one: OneRank, model: torch.nn.Module, bound: RetainedFSDP2) -> None:
    shadow_model, shadow_optimizer = one.model()
    shadow = attach_fsdp2(shadow_model, shadow_optimizer, job_id=one.job_ids[-1], rank=0, resume=False)  # views only
    _attempt(out, "shadow", lambda: shadow_model.load_state_dict(bound.state_dict(copy=True)["model"]), bound.store)
    _attempt(out, "shadow optimizer", lambda: shadow_optimizer.load_state_dict(shadow_optimizer.state_dict()),
             bound.store)
    shadow.store.close()
    # the model's parameters are replaced for good: the binding cannot be used after it
    _attempt(out, "assign", lambda: model.load_state_dict(bound.state_dict(copy=True)["model"], assign=True),
             bound.store)


def test_loads_refused_naming_the_fix_leave_the_store_incomplete():
    """What the DCP binding refuses, each leaving the store incomplete (nothing recovery trusts):
    a value that is not this rank's shard, a negative iteration, a load that replaces a shard;
    a good load after a refusal initialises the store again. Binding another optimizer to the
    store then (attach: incomplete; create: it exists) is refused and leaves its groups as they were;
    a shadow's views (attach_fsdp2(resume=False)) refuse every load before writing anything; after
    ``detach()`` loads go to the copies and restoring is refused."""
    result = run_in_child(_refusals, timeout=60)
    assert result.exit_code == 0, result
    out = result.value
    assert out["optimizer"].startswith("ConfigurationError: param 0.weight: loaded optimizer state 'exp_avg' has "
                                       "local shape (5, 3), this rank's shard (4, 3)"), out["optimizer"]
    assert "get_state_dict / set_state_dict" in out["optimizer"]
    assert out["assign"].startswith("UsageError: param 0.weight: load_state_dict replaced the retained shard") and (
        "assign=False" in out["assign"]), out["assign"]
    assert out["negative"].startswith("ConfigurationError: iteration -1:"), out["negative"]
    assert out["attach"].startswith("IncompleteStoreError: rank 0"), out["attach"]
    assert out["create"].startswith("UsageError: retained memory of job") and "attach_fsdp2" in out["create"]
    assert out["groups kept"], "a refused bind left the optimizer's param groups re-pointed"
    assert out["detached"].startswith("UsageError: restoring(): detached from retained memory"), out["detached"]
    assert out["detached complete"] is True and out["detached kept"], out
    for what in ("shadow", "shadow optimizer"):  # the active's store stays complete: nothing was written
        assert out[what].startswith("UsageError:") and "a shadow's views" in out[what], out[what]
        assert out[f"{what} complete"] is True, out
    assert out["good"] == "accepted" and out["good complete"] is True and out["iteration"] == 7, out
    assert not any(out[f"{what} complete"] for what in ("optimizer", "assign")), out
    assert out["negative complete"] is False, out


def _roll_forward(job_id: str) -> dict[int, tuple[str, int]]:
    stores = {r: RetainedStore.attach(job_id, r) for r in range(WORLD)}
    try:
        return {r: (str(rep.status_found), rep.committed_iteration) for r, rep in recover_node(stores).items()}
    finally:
        for store in stores.values():
            store.close()


@pytest.mark.slow  # LETO_LONG=1: the HOF path itself runs in CI (test_fsdp2_hof.py)
def test_hof_right_after_a_dcp_restart_recovers_in_place_bit_identical(tmp_path, plain_fsdp2, checkpoints):
    """A store initialised from a checkpoint is protected like a new one: rank 1 SIGKILLed in
    the first update after the restart, the node rolled forward, new trainers attach and
    continue: bit-identical to the uninterrupted run."""
    job = _restart_job(checkpoints[0], tmp_path, kills=((1, "chunk.tier1_done", 1),))
    job_id = job_ids(job)[RESTARTS[0][0]]
    try:
        codes = run_ranks(job, target=restart)
        assert codes[1] == -signal.SIGKILL, f"rank 1 was not killed in its first update: exit codes {codes}"
        recovery = run_in_child(lambda: _roll_forward(job_id), timeout=60)
        assert recovery.exit_code == 0, recovery
        assert recovery.value[1] == ("prepared", SAVED_AT), recovery.value
        assert all(committed == SAVED_AT for _, committed in recovery.value.values()), recovery.value
        continued = run_job(tmp_path, "continued", retained=True, job_id=job_id, attach=True)
    finally:
        for job_id_ in job_ids(job).values():
            unlink_segments(job_id_)
    assert_same_state(plain_fsdp2, continued, "HOF after a DCP restart")
    for rank in range(WORLD):
        tail = plain_fsdp2[rank]["losses"][(SAVED_AT + 1) * ACCUMULATE:]
        assert all(torch.equal(x, y) for x, y in zip(tail, continued[rank]["losses"], strict=True)), f"rank {rank}"


def _train_one_rank(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: Any, first: int,
                    stop: int) -> list[torch.Tensor]:
    for i in range(first, stop):
        model(torch.randn(2, 3, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return [p.to_local().clone() for p in model.parameters()]


FAMILIES = (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
            ("adam", lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True)))


def _families() -> dict:
    """SGD (momentum, dampening, weight decay) and Adam (amsgrad) on one gloo rank: a state dict
    taken after 2 of 3 steps, loaded plain -> bound, bound -> plain, bound -> bound; the third
    step's params equal 3 plain steps'. A constant LR schedule built before binding: no warning
    that ``optimizer.step`` was overridden."""
    out: dict = {}
    with OneRank() as one, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")

        def make(bound: bool, optimizer_of) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
            model, optimizer = one.model(optimizer_of)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)  # before binding
            if bound:
                one.bind(model, optimizer)
            return model, optimizer, schedule

        for name, optimizer_of in FAMILIES:
            reference = _train_one_rank(*make(False, optimizer_of), 0, 3)
            for source, target in ((False, True), (True, False), (True, True)):
                model, optimizer, schedule = make(source, optimizer_of)
                _train_one_rank(model, optimizer, schedule, 0, 2)
                state = detached_copy(get_state_dict(model, optimizer))
                model, optimizer, schedule = make(target, optimizer_of)
                set_state_dict(model, optimizer, model_state_dict=state[0], optim_state_dict=state[1])
                final = _train_one_rank(model, optimizer, schedule, 2, 3)
                kinds = "->".join("bound" if bound else "plain" for bound in (source, target))
                out[f"{name} {kinds}"] = all(torch.equal(x, y) for x, y in zip(reference, final, strict=True))
    out["scheduler warnings"] = [str(w.message) for w in seen if "lr_scheduler" in str(w.message)
                                 or "optimizer.step()" in str(w.message)]
    return out


def test_sgd_and_adam_amsgrad_state_dicts_interoperate_with_plain_fsdp2():
    result = run_in_child(_families, timeout=60)
    assert result.exit_code == 0, result
    out = dict(result.value)
    assert out.pop("scheduler warnings") == [], result.value
    assert out and all(out.values()), out
