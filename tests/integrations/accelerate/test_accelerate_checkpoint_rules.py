"""``LetoAccelerator.save_state``/``load_state`` in one process (``python train.py``): the
checkpoint holds every parameter (retained views share one storage, which Accelerate's
safetensors writer would otherwise drop tensors of) and this rank's Leto file, which loads with
``weights_only=True`` (a planted pickle is refused and never runs); ``load_state`` works at any
point -- before the first step, after steps, twice -- with the weights and optimizer state of a
plain ``Accelerator`` (``torch.equal``), and what it loads is retained: a trainer SIGKILLed
right after a mid-run reload, with a page of its store destroyed, resumes bit-identical; a
plain ``Accelerator``'s checkpoint loads into retained memory and ``leto_resume()`` leaves the
positioning to the loop."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch
from accelerate import Accelerator

from leto_lightning import new_job_id
from leto_lightning.accelerate import LetoAccelerator, LetoConfig
from leto_lightning.errors import UnsafeCheckpoint
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.updater.recovery import recover_node

LETO = LetoConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16)


def _prepared(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _step(model, opt) -> None:
    model(torch.ones(3, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt) -> dict:
    """Weights and the optimizer's state dict, as copies."""
    state = opt.state_dict()
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()},
            "groups": state["param_groups"]}


def _assert_equal(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i]), i
    assert a["groups"] == b["groups"]


def test_save_then_load_rules(tmp_path: Path) -> None:
    acc = LetoAccelerator(leto=LETO)
    model, opt = _prepared(acc)
    _step(model, opt)
    acc.save_state(str(tmp_path / "ckpt"))
    saved = safetensors.torch.load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert sorted(saved) == sorted(n for n, _ in model.named_parameters())  # none dropped
    assert all(torch.equal(saved[n], p.detach()) for n, p in model.named_parameters())
    optimizer = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)["state"]
    assert all(t.untyped_storage().nbytes() == t.nbytes for s in optimizer.values() for t in s.values())  # copies
    assert "state_dict" not in vars(opt)  # the copying state_dict was only for the save
    leto_file = torch.load(tmp_path / "ckpt" / "leto_state_0.pt", weights_only=True)  # plain values only
    assert leto_file["iteration"] == 1 and leto_file["payload"]["kind"] == "saved"
    acc.end_training()

    fresh = LetoAccelerator(leto=LETO)
    model, opt = _prepared(fresh)
    fresh.load_state(str(tmp_path / "ckpt"))
    fresh.load_state(str(tmp_path / "ckpt"))  # twice before the first step: the same restart
    assert all(torch.equal(saved[n], p.detach()) for n, p in model.named_parameters())
    assert fresh.leto_resume().step == 1 and fresh.retained.iteration == 1 and fresh.leto_recoveries == 0
    fresh.end_training()


def _reloading_run(accelerator, tmp_path: Path) -> list[dict]:
    """Steps, a checkpoint, more steps, the checkpoint loaded back mid-run, steps, another
    checkpoint loaded twice, steps; a snapshot after each load and at the end."""
    model, opt = _prepared(accelerator)
    sched = accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    snaps = []

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(3, 6)).square().sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    steps(3)
    accelerator.save_state(str(tmp_path / "a"))
    steps(2)
    accelerator.load_state(str(tmp_path / "a"))  # back to the best checkpoint, mid-run
    snaps.append(_snapshot(model, opt))
    steps(2)
    accelerator.save_state(str(tmp_path / "b"))
    steps(1)
    accelerator.load_state(str(tmp_path / "b"))
    accelerator.load_state(str(tmp_path / "b"))  # twice
    snaps.append(_snapshot(model, opt))
    steps(3)
    snaps.append(_snapshot(model, opt))
    return snaps


def test_load_state_after_steps_and_twice_as_plain_accelerate(tmp_path: Path) -> None:
    torch.manual_seed(1)
    expected = _reloading_run(Accelerator(cpu=True), tmp_path / "plain")
    acc = LetoAccelerator(leto=LETO)
    torch.manual_seed(1)
    got = _reloading_run(acc, tmp_path / "leto")
    for mine, theirs in zip(got, expected, strict=True):
        _assert_equal(mine, theirs)
    acc.retained.store.require_complete()  # re-encoded and marked complete after every load
    assert acc.retained.iteration == 3 + 2 + 2 + 1 + 3  # the job's count goes on: nothing is replayed
    report = recover_node({0: acc.retained.store})[0]  # what an agent would find: consistent, nothing to do
    assert report.committed_iteration == acc.retained.iteration - 1 and not report.reencoded_tier1
    acc.end_training()


STEPS_BEFORE_SAVE, STEPS_BEFORE_LOAD, STEPS_AFTER = 3, 2, 3


def _loop(accelerator, job_dir: Path) -> dict:
    """A prepared loader over fixed batches, noise drawn per step (the random state matters):
    save after 3 steps, 2 more, load the checkpoint back, 3 more; the weights, state and losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.arange(60, dtype=torch.float32).view(10, 6) / 60)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    point = accelerator.leto_resume() if isinstance(accelerator, LetoAccelerator) else None
    done, losses = (point.step if point else 0), []
    for (x,) in loader:
        loss = (model(x + 0.01 * torch.randn_like(x)) ** 2).sum()
        losses.append(loss.item())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        done += 1
        if done == STEPS_BEFORE_SAVE and point is None:
            accelerator.save_state(str(job_dir / "ckpt"))
        if done == STEPS_BEFORE_SAVE + STEPS_BEFORE_LOAD and point is None:
            accelerator.load_state(str(job_dir / "ckpt"))
        if done == STEPS_BEFORE_SAVE + STEPS_BEFORE_LOAD + STEPS_AFTER:
            break
    out = dict(_snapshot(model, opt), losses=losses)
    if isinstance(accelerator, LetoAccelerator):
        accelerator.end_training()
    return out


def test_a_mid_run_reload_is_retained_a_crash_right_after_resumes_bit_identical(tmp_path: Path) -> None:
    """SIGKILL at the first batch after the reload, one data page of the store overwritten: the
    recovery repairs it from the parity encoded at the reload, and a new process continuing from
    retained memory ends where the uninterrupted plain run does."""
    expected = _loop(Accelerator(cpu=True), tmp_path / "plain")
    job = new_job_id()
    config = LetoConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16, job_id=job)
    batches_to_kill = STEPS_BEFORE_SAVE + STEPS_BEFORE_LOAD + 1  # the batch after the reload
    crashed = run_in_child(lambda: _loop(LetoAccelerator(leto=config), tmp_path / "leto"),
                           kill_at=KillPoint("compute.begin", batches_to_kill))
    assert crashed.killed

    def resume() -> dict:
        store = RetainedStore.attach(job, 0)
        store.pages[0].fill_(0x5A)  # beyond the checksum: only parity brings it back
        report = recover_node({0: store})[0]
        store.close()
        assert report.repair is not None and report.repair.damaged == {0: [0]} and report.repair.repaired == 1
        resumed = LetoConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16, job_id=job,
                             resume="retained")
        return _loop(LetoAccelerator(leto=resumed), tmp_path / "leto")

    got = run_in_child(resume).value
    _assert_equal(got, expected)
    assert got["losses"] == expected["losses"][-STEPS_AFTER:]  # from the batch that was killed on


def test_a_reload_right_after_a_step_in_the_exact_mode(tmp_path: Path) -> None:
    """``rollback_window=True``: the update of the step before ``load_state`` is still open (it
    closes when the loop fetches its next batch); the load closes it, and the run continues as
    plain Accelerate's."""
    expected = _loop(Accelerator(cpu=True), tmp_path / "plain")
    exact = LetoConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16, rollback_window=True)
    _assert_equal(_loop(LetoAccelerator(leto=exact), tmp_path / "leto"), expected)


def test_a_plain_accelerator_checkpoint_loads_into_retained_memory(tmp_path: Path) -> None:
    plain = Accelerator(cpu=True)
    model, opt = _prepared(plain)
    _step(model, opt)
    plain.save_state(str(tmp_path / "plain"))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.state_dict()["state"]

    acc = LetoAccelerator(leto=LETO)
    model, opt = _prepared(acc)
    acc.load_state(str(tmp_path / "plain"))
    assert acc.leto_resume() is None  # no Leto file: the loop positions itself
    assert all(torch.equal(expected[n], p.detach()) for n, p in model.named_parameters())
    assert all(torch.equal(state[i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]) for i in state)
    acc.retained.store.require_complete()  # re-encoded and marked complete
    acc.end_training()


class _Planted:
    """A pickle that runs code when loaded: it creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path: Path) -> None:
    acc = LetoAccelerator(leto=LETO)
    model, opt = _prepared(acc)
    _step(model, opt)
    acc.save_state(str(tmp_path / "ckpt"))
    acc.end_training()
    ran = tmp_path / "the planted code ran"
    leto_file = tmp_path / "ckpt" / "leto_state_0.pt"
    torch.save(_Planted(str(ran)), leto_file)  # a crafted file in place of this rank's
    with open(ran.with_suffix(".control"), "wb") as f:  # the file does run code under a plain load
        pickle.dump(_Planted(str(ran.with_suffix(".ran"))), f)
    with open(ran.with_suffix(".control"), "rb") as f:
        pickle.load(f)
    assert ran.with_suffix(".ran").exists()

    fresh = LetoAccelerator(leto=LETO)
    model, opt = _prepared(fresh)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsafeCheckpoint, match=r"leto_state_0\.pt.*refused, nothing in it was run"):
        fresh.load_state(str(tmp_path / "ckpt"))
    assert not ran.exists()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing was loaded
    fresh.retained.store.require_complete()  # the store was not touched
    fresh.end_training()
    os.remove(ran.with_suffix(".ran"))


def test_the_fallback_takes_the_newest_checkpoint_every_rank_recorded(tmp_path) -> None:
    """The agent's checkpoint fallback (fallback.py): a rank that died while saving step 8 has
    not recorded it, so step 4 is taken; a new job forgets a previous job's records."""
    from leto_lightning.env import RESUME, ResumeMode
    from leto_lightning.integrations.accelerate import fallback

    for step in (4, 8):  # remember() is called once a checkpoint's files are written
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "model.safetensors").write_bytes(b"weights")
    fallback.remember(str(tmp_path), 0, 4, str(tmp_path / "step_4"))
    fallback.remember(str(tmp_path), 0, 8, str(tmp_path / "step_8"))
    fallback.remember(str(tmp_path), 1, 4, str(tmp_path / "step_4"))
    assert fallback.saved(str(tmp_path), 0) == {4: str(tmp_path / "step_4"), 8: str(tmp_path / "step_8")}
    everyone = [sorted(fallback.saved(str(tmp_path), r)) for r in range(2)]
    assert fallback.newest_of_all(everyone) == 4
    assert fallback.newest_common(str(tmp_path), 0, world=1) == (8, str(tmp_path / "step_8"))  # one rank alone
    assert fallback.newest_of_all([[], [4]]) is None
    fallback.forget(str(tmp_path), 0)
    assert fallback.saved(str(tmp_path), 0) == {} and fallback.newest_common(str(tmp_path), 0, world=1) is None
    assert fallback.restarting_from_checkpoint({RESUME: ResumeMode.CHECKPOINT})
    assert not fallback.restarting_from_checkpoint({RESUME: ResumeMode.RETAINED})
