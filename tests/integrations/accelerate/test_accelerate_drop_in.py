"""``LetoAccelerator`` where plain ``Accelerator`` code expects ``Accelerator``'s behaviour
(one process unless said; what Accelerate's own tests exercise):

- retained memory is freed when a child of a fork-based launcher exits (``debug_launcher``;
  ``notebook_launcher`` and any ``multiprocessing`` child end the same way, without ``atexit``);
- ``del accelerator`` frees it at once (no reference cycle), and its retained memory with it;
- the optimizer's state looks like torch's: ``{}`` before the first step, an entry per
  parameter from the step that first updates it (``torch.equal`` to a plain ``Accelerator``);
- an optimizer whose parameters are in no prepared model binds the parameters it holds at its
  first step, gradients computed before included (the same weights as plain Accelerate);
- an ``IterableDataset`` loader (dispatching) works for evaluation; only a step trained from it
  is refused, before anything changes.
"""

from __future__ import annotations

import gc
import os
import pickle
import weakref
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator, debug_launcher
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from leto_lightning.accelerate import LetoAccelerator, LetoConfig
from leto_lightning.errors import ConfigurationError, UsageError
from leto_lightning.retained.shm import SEGMENT_PREFIX, list_segments
from leto_lightning.testing.crash import run_in_child

LETO = LetoConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16)


def _ours() -> set[str]:
    return set(list_segments(SEGMENT_PREFIX + os.environ["LETO_JOB_PREFIX"]))


def _train_in_a_launched_child(out_dir: str) -> None:
    """What a ``debug_launcher`` worker runs: a few steps, no ``end_training``; it records the
    segments its store made."""
    acc = LetoAccelerator(leto=LETO)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        acc.backward(model(torch.ones(3, 4)).sum())
        opt.step()
        opt.zero_grad()
    names = acc.retained.store.segment_names()
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    with open(os.path.join(out_dir, f"rank{acc.process_index}"), "w") as f:
        f.write("\n".join(names))


def test_debug_launcher_children_leave_dev_shm_empty(tmp_path: Path) -> None:
    before = _ours()
    # a forked child inherits this process's Accelerate state singletons: an earlier test's
    # Accelerator would make both children rank 0 of 1 (Accelerate's own tests reset it the same way)
    AcceleratorState._reset_state(True)
    debug_launcher(_train_in_a_launched_child, args=(str(tmp_path),), num_processes=2)
    made = {n for r in range(2) for n in (tmp_path / f"rank{r}").read_text().split()}
    assert len(made) >= 2 * 4  # each rank's data, meta, parity, spec, undo (and the node's tier 2)
    assert not (made & set(os.listdir("/dev/shm")))
    assert _ours() == before


def _components(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(torch.arange(24, dtype=torch.float32).view(6, 4)), batch_size=2)
    return accelerator.prepare(model, opt, loader)


def _trained(accelerator):
    """``_components``, after one epoch of training."""
    model, opt, loader = _components(accelerator)
    for (x,) in loader:
        accelerator.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    return model, opt, loader


def test_del_accelerator_frees_it_and_its_retained_memory() -> None:
    before = _ours()
    acc = LetoAccelerator(leto=LETO)
    model, opt, _ = _trained(acc)
    names = acc.retained.store.segment_names()
    assert set(names) <= _ours()
    ref = weakref.ref(acc)
    gc.disable()  # freed by reference counting, not by the cycle collector
    try:
        del acc
        assert ref() is None
        assert _ours() == before
    finally:
        gc.enable()
    with torch.no_grad():
        assert torch.isfinite(model(torch.ones(1, 4))).all()  # the model's parameters are still valid memory
    with pytest.raises(UsageError, match="was deleted"):
        acc_less_step = model(torch.ones(1, 4)).sum()
        acc_less_step.backward()
        opt.step()


def test_the_model_stays_usable_after_end_training() -> None:
    """``end_training`` frees the retained memory (no agent); the prepared model's parameters
    view it and stay valid (saving or evaluating the model after ``end_training`` crashed with
    SIGSEGV). In a child: a crash fails the test instead of ending the session."""

    def train_then_use() -> list[float]:
        acc = LetoAccelerator(leto=LETO)
        model, _, _ = _trained(acc)
        expected = model(torch.ones(1, 4)).detach().clone()
        acc.end_training()
        with torch.no_grad():
            after = model(torch.ones(1, 4))
        assert torch.equal(after, expected)
        return after.flatten().tolist()

    result = run_in_child(train_then_use)
    assert result.signal is None and len(result.value) == 2


def test_prepared_objects_pickle_as_accelerates() -> None:
    """A prepared optimizer (before binding) and a prepared loader pickle; the copies belong to no
    accelerator (the weak references to it are not pickled)."""
    acc = LetoAccelerator(leto=LETO)
    opt = acc.prepare(torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1))
    copy = pickle.loads(pickle.dumps(opt))
    with pytest.raises(UsageError, match="was deleted"):
        copy._leto_bind_late()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    copied = list(pickle.loads(pickle.dumps(loader)))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(copied, loader, strict=True))


def _state(opt) -> dict:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a)


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.SGD(ps, lr=0.1)], ids=["adamw", "sgd-momentum", "sgd"])
def test_optimizer_state_looks_like_torchs(make_opt) -> None:
    """Before the first step ``{}``; a head that got no gradient in step 1 has no entry until
    its first update (step 2); every entry equal to plain Accelerate's."""

    def run(accelerator) -> list[dict]:
        torch.manual_seed(0)
        trunk, head_a, head_b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        model = torch.nn.ModuleList([trunk, head_a, head_b])
        model, opt = accelerator.prepare(model, make_opt(model.parameters()))
        states = [_state(opt)]
        for heads in ([1], [1, 2], [2]):
            x = model[0](torch.ones(2, 4))
            accelerator.backward(sum(model[h](x).sum() for h in heads))
            opt.step()
            opt.zero_grad()
            states.append(_state(opt))
        return states

    expected = run(Accelerator(cpu=True))
    acc = LetoAccelerator(leto=LETO)
    got = run(acc)
    assert got[0] == {} and expected[0] == {}
    assert all(_equal_states(g, e) for g, e in zip(got, expected, strict=True)), (got, expected)
    acc.end_training()


def test_optimizer_state_before_the_first_step_saves_and_loads_as_torchs(tmp_path: Path) -> None:
    acc = LetoAccelerator(leto=LETO)
    model, opt, _ = _components(acc)
    acc.save_state(str(tmp_path / "initial"))
    assert torch.load(tmp_path / "initial" / "optimizer.bin", weights_only=True)["state"] == {}
    acc.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    acc.load_state(str(tmp_path / "initial"))  # mid-run, back to before the first step
    assert opt.state_dict()["state"] == {}
    acc.backward(model(torch.ones(2, 4)).sum())
    opt.step()  # the first step again: Adam's step counts from 1, moments from zero
    assert all(float(s["step"]) == 1.0 for s in opt.state_dict()["state"].values())
    acc.end_training()


def test_an_optimizer_of_a_model_nobody_prepared_binds_its_own_parameters() -> None:
    """The optimizer is built, then a new model, and only the new one is prepared (the model the
    optimizer holds is trained unprepared): the optimizer's parameters bind at its first step,
    with the gradients computed before it."""

    def run(accelerator) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        other = torch.nn.Linear(4, 2)
        other, opt = accelerator.prepare(other, opt)
        for _ in range(3):
            accelerator.backward(model(torch.ones(3, 4)).square().sum())
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    expected = run(Accelerator(cpu=True))
    acc = LetoAccelerator(leto=LETO)
    got = run(acc)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert acc.retained is not None and acc.retained.iteration == 3  # protected: every step a transaction
    acc.end_training()


def test_an_unbindable_optimizer_is_refused_in_one_line_where_binding_must_be_at_prepare(monkeypatch) -> None:
    monkeypatch.setenv("LETO_RESUME", "retained")  # this process would continue a job: binds at prepare()
    acc = LetoAccelerator(leto=LETO)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, opt = acc.prepare(torch.nn.Linear(4, 2), opt)
    acc.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(UsageError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(2, 4\)\) belongs to no "
                                         r"prepared model.*pass the model"):
        opt.step()
    assert acc.retained is None


class _Numbers(IterableDataset):
    def __iter__(self):
        yield from (torch.full((4,), float(i)) for i in range(6))


def test_an_iterable_loader_evaluates_but_is_not_trained_from() -> None:
    acc = LetoAccelerator(leto=LETO)
    model, opt, train = _components(acc)
    evaluation = acc.prepare(DataLoader(_Numbers(), batch_size=2))
    for (x,) in train:
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert len([model(batch) for batch in evaluation]) == 3  # evaluation between steps: fine
    before = [p.detach().clone() for p in model.parameters()]
    for batch in evaluation:
        acc.backward(model(batch).sum())
        with pytest.raises(ConfigurationError, match=r"training step on batches of a dispatching data loader.*"
                                                     r"dispatch_batches=False"):
            opt.step()
        break
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # refused before any change
    assert acc.retained.iteration == 3
    acc.end_training()
