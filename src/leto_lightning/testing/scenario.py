"""A small, fully deterministic training job on retained state, for crash tests and demos.

``n_ranks`` model replicas (one per simulated device of one node, each with its own store,
tier-2 parity across them) train on seeded synthetic batches. The reference is plain
``torch.optim`` on ordinary tensors, run in lockstep: every claim "bit-identical" is checked
against it with ``torch.equal``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..env import ProcessSettings, job_prefix
from ..faults.points import point
from ..models.tiny import TinyLM
from ..retained.config import RetainedConfig
from ..retained.shm import new_job_id, unlink_segments
from ..retained.store import RetainedStore, StoreSpec
from ..updater.retained_optimizer import RetainedOptimizer, config_for, layout_for
from ..updater.store_setup import encode_tier2, no_barrier, set_up_store
from ..updater.transaction import ParityCodes

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.1, maximize=True)),
    # no chunk-wise math: one whole-state transaction per step (updater.whole_state)
    "rmsprop_whole": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True)),
    "nadam_whole": (torch.optim.NAdam, dict(lr=1e-3, weight_decay=0.01)),
}


@dataclass
class CoreScenario:
    optimizer: str = "adamw"
    n_ranks: int = 2
    config: RetainedConfig = field(default_factory=lambda: RetainedConfig(
        page_bytes=4096, chunk_pages=2, data_pages=4, tier1_parity=2, tier2_parity=1, record_bytes=1 << 16))
    seed: int = 0
    rollback: bool = False  # a rollback window, as manual optimization uses (whole-state, sealed per step)
    vocab: int = 97
    dim: int = 48

    def build(self, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(self.seed * 1000 + rank)  # devices hold different shards
        model = TinyLM(self.vocab, self.dim)
        cls, kwargs = OPTIMIZERS[self.optimizer]
        return model, cls(model.parameters(), **kwargs)

    def batch(self, rank: int, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(hash((self.seed, rank, iteration)) & 0x7FFFFFFF)
        tokens = torch.randint(0, self.vocab, (8, 16), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def compute(self, model: torch.nn.Module, rank: int, iteration: int) -> None:
        """Forward and backward of one iteration (the compute phase)."""
        x, y = self.batch(rank, iteration)
        point("compute.begin", iteration=iteration)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()

    # -- reference ---------------------------------------------------------------------
    def reference(self, iterations: int) -> list[list[dict]]:
        """Per rank, the state after each iteration 0..iterations (index 0 = initial)."""
        out = []
        for rank in range(self.n_ranks):
            model, opt = self.build(rank)
            states = [snapshot(model, opt)]
            for it in range(iterations):
                opt.zero_grad()
                self.compute(model, rank, it)
                opt.step()
                states.append(snapshot(model, opt))
            out.append(states)
        return out

    # -- retained ------------------------------------------------------------------------
    def create_job(self) -> Job:
        """Allocate and initialise every rank's store (the state manager's part)."""
        job_id = new_job_id(job_prefix())
        stores, trainers = [], []
        try:
            for rank in range(self.n_ranks):
                model, opt = self.build(rank)
                config = config_for(self.config, opt)
                layout = layout_for(opt, config, whole_state=self.rollback)
                spec = StoreSpec(job_id, rank, 0, rank, self.n_ranks, layout, config)

                def bind(store: RetainedStore, opt: torch.optim.Optimizer = opt) -> RetainedOptimizer:
                    ro = RetainedOptimizer(opt, store, rollback_window=self.rollback,
                                           settings=ProcessSettings.from_env())
                    ro.bind(adopt=False)
                    return ro

                # every rank in this process: tier 2 from all of them below, then complete
                ro = set_up_store(spec, bind, barrier=no_barrier, settings=ProcessSettings.from_env(),
                                  attach_with="Job.attach_trainer", complete=False)
                stores.append(ro.store)
                trainers.append((model, ro))
            encode_tier2(stores, ParityCodes(stores[0]))
            for store in stores:
                store.mark_complete()  # set-up done: every view bound, all parity encoded
        except BaseException:
            unlink_segments(job_id)
            raise
        return Job(self, job_id, stores, trainers)


@dataclass
class Job:
    scenario: CoreScenario
    job_id: str
    stores: list[RetainedStore]
    trainers: list[tuple[torch.nn.Module, RetainedOptimizer]]

    def step(self, rank: int, iteration: int) -> None:
        run_step(self.scenario, *self.trainers[rank], rank, iteration)

    def run(self, iterations: int) -> None:
        """Iterations ``0 .. iterations - 1`` on every rank, rank by rank within each (lockstep)."""
        for iteration in range(iterations):
            for rank in range(self.scenario.n_ranks):
                self.step(rank, iteration)

    def attach_trainer(self, rank: int) -> tuple[torch.nn.Module, RetainedOptimizer]:
        """What a shadow does: build the skeleton and bind it to the retained store."""
        store = RetainedStore.attach(self.job_id, rank)
        model, opt = self.scenario.build(rank)
        ro = RetainedOptimizer(opt, store, rollback_window=self.scenario.rollback, settings=ProcessSettings.from_env())
        ro.bind(adopt=True)
        return model, ro

    def state(self, rank: int) -> dict:
        model, ro = self.trainers[rank]
        return snapshot(model, ro.optimizer)

    def close(self) -> list[str]:
        for s in self.stores:
            s.close()
        return unlink_segments(self.job_id)


def run_step(scenario: CoreScenario, model: torch.nn.Module, ro: RetainedOptimizer, rank: int, iteration: int) -> None:
    if ro.iteration != iteration:
        raise RuntimeError(f"rank {rank} is at iteration {ro.iteration}, asked to run {iteration}")
    ro.zero_grad()
    scenario.compute(model, rank, iteration)
    ro.step()
    if ro.rollback_window:
        ro.seal(None)  # the batch end, where manual optimization seals its step


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copies of the weights and the optimizer state (``state_dict`` form)."""
    sd = optimizer.state_dict()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in sd["state"].items()},
    }


def differences(actual: dict, expected: dict) -> list[str]:
    """Human-readable list of what is not bit-identical (``torch.equal``); empty if equal."""
    out = [f"param {i}" for i, (a, b) in enumerate(zip(actual["params"], expected["params"])) if not torch.equal(a, b)]
    for i, s in expected["state"].items():
        for k, v in s.items():
            got = actual["state"].get(i, {}).get(k)
            if not isinstance(got, torch.Tensor) or got.dtype != v.dtype or not torch.equal(got, v):
                out.append(f"state {i}.{k}")
    return out
