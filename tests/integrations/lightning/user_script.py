"""A Lightning script as a user writes it (not the project's example): no thread settings, no
Leto API, nothing but ``--strategy`` differs between its ``torchrun`` and ``leto launch`` runs.

    torchrun --nproc-per-node 2 user_script.py --strategy ddp --out DIR
    leto launch --nproc-per-node 2 user_script.py --strategy leto --out DIR

A small attention model with LayerNorm and dropout, AdamW with a cosine schedule stepped per
batch, gradient clipping, validation every few steps. Each rank saves ``DIR/rank<r>.pt``: its
weights, the optimizer state and every training step's loss, as tensors (compared with
``torch.equal`` by test_lightning_torchrun_identity.py).
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class AttentionClassifier(pl.LightningModule):
    def __init__(self, vocab: int = 50, dim: int = 48, heads: int = 4, classes: int = 5, total_steps: int = 12) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)
        self.step_losses: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.ff(self.norm2(x))
        return self.head(x.mean(dim=1))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_losses.append(outputs["loss"].detach().clone())

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        self.log("val_loss", F.cross_entropy(self(tokens), labels), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.05)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


def loader(n: int, seed: int, shuffle: bool) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (n, 16), generator=g)
    labels = (tokens[:, :4].sum(dim=1) % 5)
    return DataLoader(TensorDataset(tokens, labels), batch_size=8, shuffle=shuffle)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    args = p.parse_args()
    if args.strategy == "leto":
        import leto_lightning  # noqa: F401  registers Trainer(strategy="leto")

    pl.seed_everything(7)
    model = AttentionClassifier(total_steps=args.max_steps)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, max_steps=args.max_steps,
                         gradient_clip_val=0.5, val_check_interval=4, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(256, 1, shuffle=True), loader(32, 2, shuffle=False))
    os.makedirs(args.out, exist_ok=True)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optimizer": trainer.optimizers[0].state_dict(),
                "losses": torch.stack(model.step_losses),
                "threads": torch.get_num_threads(),
                "global_step": trainer.global_step},
               os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
