"""Fault-free iteration time of ``LetoAccelerator`` vs ``accelerate.Accelerator``, same run.

    python benchmarks/accelerate_overhead.py [--sizes small,medium,large] [--iterations N]

One process (no launcher, no shadows: the per-step cost a training job pays), the compact MoE
transformer at three sizes chosen for steps of about 30 ms, 300 ms and 3 s on a 2-core CPU
machine, AdamW, accumulation 1, clipping. For each size both accelerators train the same model
from the same weights on the same batches, interleaved (A, B, A, B, ...) so drift in the
machine's speed hits both; the per-iteration medians and their ratio are printed, and the final
weights are checked bit-identical. Accelerate's state is one per process, so both accelerators
share it (``cpu=True``).

The update columns time ``opt.step()`` alone and ``upd. only`` is (median Leto update - median
plain update) / median plain iteration: the part of the overhead that is the update, with the
forward/backward noise of a shared machine left out (at the large size 6 iterations of ~5 s
steps vary by several per cent, more than the target).
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

    def step(self, batch: torch.Tensor) -> tuple[float, float]:
        """Seconds for the whole iteration and for ``opt.step()`` alone."""
        t0 = time.perf_counter()
        logits, aux = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) + 0.01 * aux
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.opt.zero_grad()
        return time.perf_counter() - t0, t2 - t1


def run_size(name: str, iterations: int, warmup: int) -> tuple[dict[str, float], dict[str, float], bool]:
    """Medians per trainer ("plain", "leto") of the iteration and of the update, and bit-identity."""
    from accelerate import Accelerator

    from leto_lightning.accelerate import LetoAccelerator, LetoConfig

    d_model, layers, seq_len, batch = SIZES[name]
    cfg = model_config(d_model, layers, seq_len)
    plain = Trainer(Accelerator(cpu=True), cfg)
    leto_acc = LetoAccelerator(cpu=True, leto=LetoConfig(page_bytes=1 << 20, tier1_parity=1))
    leto = Trainer(leto_acc, cfg)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"plain": [], "leto": []}
    updates: dict[str, list[float]] = {"plain": [], "leto": []}
    for it in range(warmup + iterations):
        batch_t = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
        for key, trainer in (("plain", plain), ("leto", leto)) if it % 2 == 0 else (("leto", leto), ("plain", plain)):
            dt, du = trainer.step(batch_t)
            if it >= warmup:
                times[key].append(dt)
                updates[key].append(du)
    same = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), leto.model.parameters()))
    leto_acc.end_training()  # frees the retained memory
    medians = {k: statistics.median(v) for k, v in times.items()}
    return medians, {k: statistics.median(v) for k, v in updates.items()}, same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="small,medium,large")
    p.add_argument("--iterations", type=int, default=0, help="timed iterations per size (0: 40/20/6)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    defaults = {"small": 40, "medium": 20, "large": 6}
    print(f"{'size':8} {'Accelerator':>12} {'LetoAccelerator':>16} {'ratio':>7}  {'update: plain':>13} "
          f"{'Leto':>8} {'upd. only':>9}  bit-identical")
    for name in args.sizes.split(","):
        n = args.iterations or defaults[name]
        total, update, same = run_size(name, n, warmup=2)
        plain, leto = total["plain"], total["leto"]
        upd_only = (update["leto"] - update["plain"]) / plain
        print(f"{name:8} {plain * 1e3:10.1f}ms {leto * 1e3:14.1f}ms {leto / plain:7.3f}  "
              f"{update['plain'] * 1e3:11.1f}ms {update['leto'] * 1e3:6.1f}ms {upd_only * 100:+8.2f}%  {same}",
              flush=True)


if __name__ == "__main__":
    main()
