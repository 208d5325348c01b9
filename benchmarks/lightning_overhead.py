"""Fault-free per-step cost of ``Trainer(strategy="leto")`` beside ``Trainer(strategy="ddp")``
(docs/benchmarks/lightning-overhead.md).

The same LightningModule (embedding, pre-norm attention blocks with LayerNorm and dropout,
AdamW, a cosine schedule, gradient clipping) is fitted with ``"ddp"`` and with ``"leto"`` in
one process (one rank, gloo), at three step times -- about 15 ms, 150 ms and 1.5 s on a
2-core CPU machine -- chosen by the batch size and width. Fits alternate strategy by strategy
and round by round (ddp, leto, then leto, ddp, ...), so noise from other processes on the
machine hits both alike; each fit's first ``--warmup`` steps are not counted. A step's time
is from one ``on_train_batch_start`` to the next: forward, backward, clipping, the optimizer
step (for ``"leto"``: the retained transactions and every payload record) and every hook.

Reported per size: the median step time of each strategy over all counted steps, the ratio
(leto / ddp) of those medians, the median of the per-round ratios (paired), and the fixed
cost per step in ms. The final weights of each round's two fits are compared with
``torch.equal`` (one intra-op thread: ``"leto"`` must be bit-identical to ``"ddp"``).

    python benchmarks/lightning_overhead.py                  # the doc's run (~6 min on 2 cores)
    python benchmarks/lightning_overhead.py --sizes 15ms --rounds 2 --steps 10   # smoke, ~30 s
    python benchmarks/lightning_overhead.py --profile 15ms   # cProfile of one leto fit's steps
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import logging
import os
import platform
import pstats
import statistics
import time
import warnings

import lightning
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import leto_lightning
from leto_lightning import new_job_id
from leto_lightning.retained.shm import unlink_segments

# name: (width, layers, batch, seq) -- step times on a 2-vCPU Xeon, one thread
SIZES = {"15ms": (64, 2, 8, 32), "150ms": (128, 4, 16, 32), "1500ms": (256, 4, 16, 96)}
VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class BenchLM(pl.LightningModule):
    def __init__(self, dim: int, layers: int, total_steps: int) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.head(self.ln(self.blocks(self.embed(tokens))))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


class StepTimer(Callback):
    """Times every step: one ``on_train_batch_start`` to the next (the last step: to fit end)."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []  # (wall, this process's CPU time)
        self.end = (0.0, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = (time.perf_counter(), time.process_time())

    def steps(self) -> list[tuple[float, float]]:
        """(wall s, CPU s) of every step."""
        marks = [*self.starts, self.end]
        return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)]


def fit(strategy: str, size: str, steps: int,
        page_kib: int = 0) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """One fit of ``steps`` steps; returns each step's (wall, CPU) seconds and the final weights."""
    dim, layers, batch, seq = SIZES[size]
    pl.seed_everything(3, verbose=False)
    model = BenchLM(dim, layers, steps)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (batch * steps, seq + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=False)
    job = new_job_id()
    retained = {"page_bytes": page_kib * 1024} if page_kib else {}  # default: RetainedConfig's
    chosen = pl.strategies.DDPStrategy() if strategy == "ddp" else leto_lightning.integrations.lightning.LetoStrategy(
        job_id=job, **retained)
    timer = StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=chosen, max_steps=steps, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer])
    try:
        trainer.fit(model, data)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}  # leto: views, unmapped below
    finally:
        if strategy == "leto":
            chosen.release(unlink=True)
            unlink_segments(job)
    return timer.steps(), weights


def bench(size: str, rounds: int, steps: int, warmup: int, out, page_kib: int = 0) -> dict:
    wall: dict[str, list[float]] = {"ddp": [], "leto": []}
    cpu: dict[str, list[float]] = {"ddp": [], "leto": []}
    ratios, identical = [], True
    for r in range(rounds):
        order = ("ddp", "leto") if r % 2 == 0 else ("leto", "ddp")
        medians, weights = {}, {}
        for name in order:
            step_s, weights[name] = fit(name, size, steps + warmup, page_kib)
            counted = step_s[warmup:]
            wall[name] += [w for w, _ in counted]
            cpu[name] += [c for _, c in counted]
            medians[name] = statistics.median(w for w, _ in counted)
        ratios.append(medians["leto"] / medians["ddp"])
        identical &= all(torch.equal(weights["ddp"][n], weights["leto"][n]) for n in weights["ddp"])
        out(f"  {size} round {r + 1}/{rounds}: ddp {medians['ddp'] * 1e3:8.2f} ms  leto {medians['leto'] * 1e3:8.2f} ms"
            f"  ratio {ratios[-1]:.4f}")
    ddp, leto = statistics.median(wall["ddp"]), statistics.median(wall["leto"])
    ddp_cpu, leto_cpu = statistics.median(cpu["ddp"]), statistics.median(cpu["leto"])
    return dict(size=size, ddp=ddp, leto=leto, ratio=leto / ddp, paired=statistics.median(ratios),
                fixed_ms=(leto - ddp) * 1e3, ddp_cpu=ddp_cpu, leto_cpu=leto_cpu, cpu_ratio=leto_cpu / ddp_cpu,
                identical=identical, n=len(wall["ddp"]))


def profile(size: str, steps: int) -> None:
    """cProfile of one leto fit (setup included; the hot path shows as per-call costs)."""
    prof = cProfile.Profile()
    prof.enable()
    fit("leto", size, steps)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(40)
    print(text.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    p.add_argument("--rounds", type=int, default=6, help="pairs of fits per size (strategy order alternates)")
    p.add_argument("--steps", type=int, default=0, help="counted steps per fit (0: 40 / 16 / 6 by size)")
    p.add_argument("--warmup", type=int, default=3, help="uncounted first steps of every fit")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both strategies)")
    p.add_argument("--page-kib", type=int, default=0, help="retained page size for leto (0: the default, 1 MiB)")
    p.add_argument("--profile", metavar="SIZE", help="profile one leto fit of SIZE instead")
    args = p.parse_args()
    # Lightning's DDP launcher sets torch's thread count to cpu_count // devices unless
    # OMP_NUM_THREADS is set; set it, so that both strategies run with --threads.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    default_steps = {"15ms": 40, "150ms": 16, "1500ms": 6}
    if args.profile:
        profile(args.profile, args.steps or default_steps[args.profile])
        return
    out = lambda s: print(s, flush=True)  # noqa: E731
    out(f"torch {torch.__version__}, lightning {lightning.__version__}, Python {platform.python_version()}, "
        f"{args.threads} intra-op thread(s), {os.cpu_count()} CPUs; one rank (gloo); rounds {args.rounds}, "
        f"warm-up {args.warmup} steps per fit; leto pages: {args.page_kib or 1024} KiB")
    rows = [bench(size, args.rounds, args.steps or default_steps[size], args.warmup, out, args.page_kib)
            for size in args.sizes.split(",")]
    out("\n| step size | ddp ms/step | leto ms/step | leto / ddp (wall) | paired ratio | fixed cost ms/step | "
        "ddp CPU ms/step | leto CPU ms/step | leto / ddp (CPU) | steps | bit-identical |")
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        out(f"| {r['size']} | {r['ddp'] * 1e3:.2f} | {r['leto'] * 1e3:.2f} | {(r['ratio'] - 1) * 100:+.2f} % | "
            f"{(r['paired'] - 1) * 100:+.2f} % | {r['fixed_ms']:.2f} | {r['ddp_cpu'] * 1e3:.2f} | "
            f"{r['leto_cpu'] * 1e3:.2f} | {(r['cpu_ratio'] - 1) * 100:+.2f} % | {r['n']} | "
            f"{'yes' if r['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()
