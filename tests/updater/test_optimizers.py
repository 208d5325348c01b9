"""Chunk-wise optimizer math is bit-identical to torch.optim's own step()."""

from __future__ import annotations

import pytest
import torch

from leto_lightning.retained.config import RetainedConfig
from leto_lightning.updater.retained_optimizer import RetainedOptimizer, UnsupportedOptimizerError

CASES = {
    "sgd_plain": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum_wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_dampening_maximize": (torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam_wd_amsgrad": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
    "adam_maximize": (torch.optim.Adam, dict(lr=1e-3, maximize=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    # whole-state transactions (no chunk-wise math): torch's own step on retained views
    "rmsprop_centered": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-3)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-3)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-3)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-3)),
}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(23, 41)
        self.b = torch.nn.Linear(41, 7)
        self.unused = torch.nn.Linear(3, 3)  # never receives a gradient: must stay untouched
        self.low = torch.nn.Parameter(torch.randn(13, dtype=torch.bfloat16))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.low.float().sum()


def _groups(model):
    return [{"params": [model.a.weight, model.a.bias, model.low, model.unused.weight, model.unused.bias]},
            {"params": [model.b.weight, model.b.bias], "lr": 3e-3}]


def _run(cls, kwargs, retained: bool, config=None, steps=4):
    torch.manual_seed(0)
    model = Net()
    opt = cls(_groups(model), **kwargs)
    ro = RetainedOptimizer.create(opt, config) if retained else None
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(9, 23, generator=g)
        (ro or opt).zero_grad()
        model(x).square().mean().backward()
        if i == 2:
            opt.param_groups[0]["lr"] *= 0.5  # a scheduler changing lr mid-run
        (ro or opt).step()
    state = opt.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    if ro is not None:
        state = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()}}
        ro.store.close()
        ro.store.unlink()
    return params, state


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("page_bytes,chunk_pages", [(256, 1), (1024, 3)])
def test_chunked_step_matches_torch(case, page_bytes, chunk_pages):
    cls, kwargs = CASES[case]
    cfg = RetainedConfig(page_bytes=page_bytes, chunk_pages=chunk_pages, data_pages=4, tier1_parity=1,
                         record_bytes=4096)
    ref_params, ref_state = _run(cls, kwargs, retained=False)
    params, state = _run(cls, kwargs, retained=True, config=cfg)
    for i, (a, b) in enumerate(zip(params, ref_params)):
        assert torch.equal(a, b), f"param {i} differs"
    assert set(state["state"]) == set(ref_state["state"]) | set(state["state"])
    for i, s in ref_state["state"].items():
        for k, v in s.items():
            assert torch.equal(state["state"][i][k], v), f"state {i}.{k} differs"


def test_params_are_views_into_retained_memory():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ro = RetainedOptimizer.create(opt, RetainedConfig(page_bytes=512, record_bytes=4096))
    try:
        def inside(t, what):
            seg = ro.store.segments[what].tensor
            return seg.data_ptr() <= t.data_ptr() < seg.data_ptr() + seg.numel()

        for p in model.parameters():
            assert inside(p, "data") and inside(p.grad, "data")
            for k, v in opt.state[p].items():
                assert inside(v, "meta" if k == "step" else "data"), k
    finally:
        ro.store.close()
        ro.store.unlink()


def test_optimizer_with_unretainable_state_is_refused_by_name():
    class Odd(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["history"] = [1, 2, 3]  # not a tensor: cannot be retained
            return super().step(closure)

    with pytest.raises(UnsupportedOptimizerError, match="'history'"):
        RetainedOptimizer.create(Odd(Net().parameters(), lr=0.1), RetainedConfig(page_bytes=512))


@pytest.mark.parametrize("optimizer", ["rmsprop_whole", "adamw"])
def test_shadow_bound_before_the_first_step_resumes_with_the_lazy_state(optimizer):
    """A shadow binds its views while the active trainer has not stepped yet (no optimizer state
    exists: torch creates it at the first step). Promoted later, it must continue with the state
    the active trainer built, not start a fresh one. (Found with manual optimization under
    ``leto launch``: every whole-state optimizer is affected.)"""
    from leto_lightning.testing.scenario import CoreScenario, differences, run_step, snapshot

    sc = CoreScenario(optimizer=optimizer, n_ranks=1, rollback=optimizer == "adamw")
    reference = sc.reference(3)
    job = sc.create_job()
    try:
        shadow_model, shadow_opt = sc.build(0)
        shadow = RetainedOptimizer(shadow_opt, job.stores[0], rollback_window=sc.rollback)
        shadow.bind(adopt=True, resume=False)  # pre-initialised before any step
        for it in range(2):
            job.step(0, it)
        shadow.resume()  # promoted
        run_step(sc, shadow_model, shadow, 0, 2)
        assert differences(snapshot(shadow_model, shadow_opt), reference[0][3]) == []
    finally:
        job.close()
