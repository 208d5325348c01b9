"""The core on one rank, as the README's "Using the core" shows it: protect an optimizer, train,
lose the trainer, recover the retained state in a fresh process, continue -- bit-identical.

    python examples/core_single_rank.py
"""

from __future__ import annotations

import os

import torch

from leto_lightning import RetainedConfig, RetainedOptimizer, RetainedStateError, RetainedStore, recover_node
from leto_lightning.faults import set_hook


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same skeleton in every process
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def train(model, ro: RetainedOptimizer, first: int, last: int) -> None:
    for i in range(first, last):
        ro.zero_grad()
        x, y = batch(i)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ro.step()  # prepare -> chunk transactions -> commit


def main() -> None:
    torch.set_num_threads(1)
    config = RetainedConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16)
    model, opt = build()
    ro = RetainedOptimizer.create(opt, config, job_id=f"example-{os.getpid()}")  # or leave job_id out: a random one
    job_id = ro.store.spec.job_id  # what a new process needs, with the rank, to find the store
    train(model, ro, 0, 5)
    pid = os.fork()
    if pid == 0:  # a trainer that dies in the middle of iteration 5's update (as if SIGKILLed)
        set_hook(lambda name, context: os._exit(9) if name == "chunk.math_done" else None)
        train(model, ro, 5, 6)
        os._exit(0)
    os.waitpid(pid, 0)
    ro.store.close()

    # A fresh trainer: attach by (job id, rank), recover, bind a new skeleton, continue.
    stores = {0: RetainedStore.attach(job_id, 0)}  # {local rank: store} of this node
    try:
        reports = recover_node(stores)  # -> {local rank: RecoveryReport}
    except RetainedStateError as exc:  # beyond repair, or half-initialised: the checkpoint instead
        raise SystemExit(f"resume from the last checkpoint: {exc}") from None
    report = reports[0]
    print(report.summary())
    model2, opt2 = build()
    ro2 = RetainedOptimizer(opt2, stores[0])
    ro2.bind(adopt=True)  # params, grads and optimizer state are views into the store again
    assert ro2.iteration == report.resume_iteration == 6
    train(model2, ro2, report.resume_iteration, 8)

    ref_model, ref_opt = build()  # the same run with plain torch.optim, never interrupted
    for i in range(8):
        ref_opt.zero_grad()
        x, y = batch(i)
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
    same = all(torch.equal(a, b) for a, b in zip(model2.parameters(), ref_model.parameters()))
    print(f"bit-identical to torch.optim after the crash: {same}")
    stores[0].unlink()  # free the retained memory (/dev/shm/leto-<job>-*)
    stores[0].close()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
