"""Fault-free iteration time of ``LetoAccelerator`` vs ``accelerate.Accelerator``, same run.

    python benchmarks/accelerate_overhead.py [--sizes small,medium,large] [--iterations N] [--one-thread-ab]

One process (no launcher, no shadows: the per-step cost a training job pays), the compact MoE
transformer at three sizes chosen for steps of about 30 ms, 300 ms and 3 s on a 2-core CPU
machine, AdamW, accumulation 1, clipping. For each size both accelerators train the same model
from the same weights on the same batches, interleaved (A, B, A, B, ...) so drift in the
machine's speed hits both (with ``--one-thread-ab`` all three, in rotation); the per-iteration
medians and their ratio are printed, and the final weights are checked bit-identical.
Accelerate's state is one per process, so the accelerators share it (``cpu=True``).

``--one-thread-ab`` adds a third trainer, interleaved with the two: ``LetoAccelerator`` with the
transactions' helper thread switched off (``updater.page_work``: undo copy and checksums on the
updating thread alone), so one run shows what the helper thread buys.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leto_lightning.models.config import ModelConfig
from leto_lightning.models.moe_transformer import build_model

SIZES = {  # name: (d_model, layers, seq_len, batch)
    "small": (64, 2, 64, 4),
    "medium": (192, 4, 128, 8),
    "large": (384, 6, 256, 16),
}


def model_config(d_model: int, layers: int, seq_len: int) -> ModelConfig:
    return ModelConfig(vocab_size=512, d_model=d_model, n_layers=layers, n_heads=4, n_kv_heads=4,
                       ffn_hidden=4 * d_model, expert_ffn_hidden=2 * d_model, n_experts=4, top_k=2, seq_len=seq_len)


class Trainer:
    """One accelerator's model, optimizer and step."""

    def __init__(self, accelerator, cfg: ModelConfig) -> None:
        self.acc = accelerator
        model = build_model(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        self.model, self.opt = accelerator.prepare(model, opt)
        self.vocab = cfg.vocab_size

    def step(self, batch: torch.Tensor) -> float:
        t0 = time.perf_counter()
        logits, aux = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) + 0.01 * aux
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0


def run_size(name: str, iterations: int, warmup: int, one_thread_ab: bool = False) -> dict[str, float]:
    """Median seconds per iteration of each trainer ("plain", "leto"[, "leto-1t"]) and "same"."""
    from accelerate import Accelerator

    from leto_lightning.accelerate import LetoAccelerator, LetoConfig
    from leto_lightning.updater.page_work import PageWork

    d_model, layers, seq_len, batch = SIZES[name]
    cfg = model_config(d_model, layers, seq_len)
    trainers = {"plain": Trainer(Accelerator(cpu=True), cfg)}
    accelerators = []
    for key in ("leto", "leto-1t") if one_thread_ab else ("leto",):
        accelerators.append(LetoAccelerator(cpu=True, leto=LetoConfig(page_bytes=1 << 20, tier1_parity=1)))
        trainers[key] = Trainer(accelerators[-1], cfg)
        if key == "leto-1t":
            accelerators[-1].retained.txn.work = PageWork(helpers=0)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {key: [] for key in trainers}
    keys = list(trainers)
    for it in range(warmup + iterations):
        batch_t = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
        for key in keys[it % len(keys):] + keys[:it % len(keys)]:  # each trainer first in turn
            dt = trainers[key].step(batch_t)
            if it >= warmup:
                times[key].append(dt)
    params = [list(t.model.parameters()) for t in trainers.values()]
    same = all(torch.equal(a, b) for other in params[1:] for a, b in zip(params[0], other))
    for acc in accelerators:
        acc.end_training()  # frees the retained memory
    return {**{key: statistics.median(v) for key, v in times.items()}, "same": float(same)}


def helper_line() -> str:
    """Whether the transactions' helper thread takes work now (it steps aside on a full run queue)."""
    import os

    from leto_lightning.updater.page_work import SHARED

    load = os.getloadavg()[0]
    return (f"transaction helper thread: {SHARED.helpers} ({'in use' if SHARED.active() else 'not in use'}: "
            f"1-minute load average {load:.2f}, {len(os.sched_getaffinity(0))} CPUs)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,medium,large")
    p.add_argument("--iterations", type=int, default=0, help="timed iterations per size (0: 40/20/6)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one-thread-ab", action="store_true",
                   help="also time LetoAccelerator without the transactions' helper thread")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    defaults = {"small": 40, "medium": 20, "large": 6}
    extra = f" {'Leto 1 thread':>14} {'ratio':>7}" if args.one_thread_ab else ""
    print(helper_line())
    print(f"{'size':8} {'Accelerator':>12} {'LetoAccelerator':>16} {'ratio':>7}{extra}  bit-identical")
    for name in args.sizes.split(","):
        n = args.iterations or defaults[name]
        r = run_size(name, n, warmup=2, one_thread_ab=args.one_thread_ab)
        plain, leto = r["plain"], r["leto"]
        row = f"{name:8} {plain * 1e3:10.1f}ms {leto * 1e3:14.1f}ms {leto / plain:7.3f}"
        if args.one_thread_ab:
            row += f" {r['leto-1t'] * 1e3:12.1f}ms {r['leto-1t'] / plain:7.3f}"
        print(f"{row}  {bool(r['same'])}", flush=True)
    print(helper_line())


if __name__ == "__main__":
    main()
