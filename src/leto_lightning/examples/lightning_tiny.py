"""A tiny transformer language model trained by an ordinary Lightning script.

    leto launch --nproc-per-node 2 lightning_tiny.py --max-steps 40 [--wandb]

Nothing in it is Leto-specific except ``strategy="leto"``: the same script runs as the active
trainers and as their shadows, and survives HOFs in place. Deterministic on CPU: with and
without failures it ends with bit-identical weights and optimizer state (``RUN_DIR/
final_rank<r>.pt``) and the same logged loss series (``RUN_DIR/csv/version_0/metrics.csv``).
``RUN_DIR`` is ``$LETO_RUN_DIR`` (set by ``leto launch``), else ``--out``. After a failure that
is not a HOF, ``leto launch`` restarts the script with ``LETO_RESUME=checkpoint``: it passes
``ckpt_path="last"`` (a ModelCheckpoint every ``--checkpoint-every`` steps).

The data is a fixed random Markov chain over the vocabulary, so the loss falls visibly.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import leto_lightning  # noqa: F401  registers Trainer(strategy="leto")
from leto_lightning.env import RESUME, RUN_DIR, ResumeMode


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformerLM(pl.LightningModule):
    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 2, layers: int = 2, seq: int = 32,
                 dropout: float = 0.1, lr: float = 3e-3, warmup: int = 5, total_steps: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10 %
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            progress = min(1.0, (step - hp.warmup) / max(1, hp.total_steps - hp.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class ManualTinyTransformerLM(TinyTransformerLM):
    """``--manual``: the same model trained with manual optimization (clipping, the step and
    the scheduler in ``training_step``; the loss logged after the step)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = self._loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        sched.step()
        self.log("train_loss", loss)
        return loss


def markov_data(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    """Sequences from a fixed random Markov chain (a few likely successors per token)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    probs = torch.softmax(logits, dim=1)
    tokens = torch.empty(n, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=g).squeeze(1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class SlowDown(pl.Callback):
    """``--sleep``: stretch each step (gives an outside observer time to act)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--devices", type=int, default=2, help="ranks per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="leto")
    p.add_argument("--page-bytes", type=int, default=0,
                   help="retained page size (0: LetoStrategy's default); small pages = several chunks per step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches-per-epoch", type=int, default=10, help="per rank")
    p.add_argument("--val-every", type=int, default=5, help="validation every N training batches")
    p.add_argument("--checkpoint-every", type=int, default=10, help="ModelCheckpoint every N steps (0: off)")
    p.add_argument("--wandb", action="store_true", help="also log to wandb (offline)")
    p.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard (RUN_DIR/tb)")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds added to every step")
    p.add_argument("--manual", action="store_true", help="manual optimization (the step inside training_step)")
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "16-mixed"),
                   help="16-mixed: fp16 autocast with a GradScaler (on CPU through the MixedPrecision plugin)")
    p.add_argument("--out", default="lightning_tiny_out", help="output directory without leto launch")
    return p.parse_args()


def loggers_and_callbacks(args: argparse.Namespace, run_dir: str) -> tuple[list, list]:
    loggers: list = [CSVLogger(run_dir, name="csv")]
    if args.wandb:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(offline=True, save_dir=run_dir, project="leto-lightning-tiny"))
    if args.tensorboard:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir, name="tb", default_hp_metric=False))
    callbacks: list = []
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(run_dir, "lightning_checkpoints"),
                                         every_n_train_steps=args.checkpoint_every, save_last=True))
    if args.sleep:
        callbacks.append(SlowDown(args.sleep))
    return loggers, callbacks


def trainer_for(args: argparse.Namespace, run_dir: str) -> pl.Trainer:
    strategy = args.strategy
    if strategy == "leto" and args.page_bytes:  # the same strategy, one option changed
        from leto_lightning.integrations.lightning import LetoStrategy

        strategy = LetoStrategy(page_bytes=args.page_bytes)
    precision: dict = {"precision": args.precision}
    if args.precision == "16-mixed":  # on CPU, Trainer(precision="16-mixed") would mean bf16-mixed
        from lightning.pytorch.plugins.precision import MixedPrecision

        # a high initial scale and a short growth interval: steps overflow, the scale backs off and grows
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    loggers, callbacks = loggers_and_callbacks(args, run_dir)
    return pl.Trainer(
        **precision, strategy=strategy, devices=args.devices, num_nodes=args.num_nodes, accelerator="cpu",
        max_steps=args.max_steps, logger=loggers, callbacks=callbacks, log_every_n_steps=1,
        val_check_interval=args.val_every, limit_val_batches=2, num_sanity_val_steps=1,
        gradient_clip_val=None if args.manual else 1.0, deterministic=True, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(args.checkpoint_every))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    run_dir = os.environ.get(RUN_DIR, args.out)
    pl.seed_everything(0, workers=True, verbose=False)
    world = args.devices * args.num_nodes
    train = markov_data(args.batch_size * args.batches_per_epoch * world, 32, 32, seed=1)
    val = markov_data(32, 32, 32, seed=2)
    model = (ManualTinyTransformerLM if args.manual else TinyTransformerLM)(total_steps=args.max_steps)
    trainer = trainer_for(args, run_dir)
    # leto launch's slow path (a failure that is not a HOF): restart from the last checkpoint file.
    # (A promoted shadow ignores ckpt_path: it continues from retained memory.)
    ckpt_path = "last" if os.environ.get(RESUME) == ResumeMode.CHECKPOINT and args.checkpoint_every else None
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(val, batch_size=args.batch_size), ckpt_path=ckpt_path)

    os.makedirs(run_dir, exist_ok=True)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optimizer": trainer.optimizers[0].state_dict(), "global_step": trainer.global_step},
               os.path.join(run_dir, f"final_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
