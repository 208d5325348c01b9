"""A Lightning script for the GPU check: a small transformer LM on one or more GPUs.

    python lightning_job.py --strategy ddp --devices 1 --out ref/          # the reference
    leto launch --nproc-per-node 1 lightning_job.py --strategy leto         # under Leto

Only ``strategy`` differs between the two. ``--pg-backend gloo`` (two ranks sharing one GPU,
which NCCL refuses). Writes ``final_rank<r>.pt`` (weights and optimizer state) to ``$LETO_RUN_DIR``
or ``--out``; after a failure that is not a HOF ``leto launch`` restarts it with
``LETO_RESUME=checkpoint`` and it resumes from its last checkpoint file.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TinyLM, cosine, dataset, deterministic, final_state, loss_of


class LitLM(pl.LightningModule):
    def __init__(self, total_steps: int, dim: int, layers: int) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.net = TinyLM(dim=dim, layers=layers)

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(self.total_steps, 4))
        return [opt], [{"scheduler": sched, "interval": "step"}]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="leto")
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--pg-backend", default=None, help="process group backend (default: nccl on GPUs)")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--out", default="lightning_job_out")
    args = p.parse_args()
    deterministic()
    out = os.environ.get("LETO_RUN_DIR", args.out)
    pl.seed_everything(0, workers=True, verbose=False)
    strategy: object = args.strategy
    if args.pg_backend:
        if args.strategy == "leto":
            from leto_lightning.integrations.lightning import LetoStrategy

            strategy = LetoStrategy(process_group_backend=args.pg_backend)
        else:
            from lightning.pytorch.strategies import DDPStrategy

            strategy = DDPStrategy(process_group_backend=args.pg_backend)
    elif args.strategy == "leto":
        import leto_lightning  # noqa: F401  registers strategy="leto"
    world = args.devices * args.num_nodes
    data = torch.utils.data.DataLoader(dataset(16 * 8 * world), batch_size=16, shuffle=True)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=args.checkpoint_every,
                           save_last=True)
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         num_nodes=args.num_nodes, precision=args.precision, max_steps=args.max_steps,
                         deterministic=True, gradient_clip_val=1.0, logger=False, callbacks=[ckpt],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    model = LitLM(args.max_steps, args.dim, args.layers)
    resume = "last" if os.environ.get("LETO_RESUME") == "checkpoint" else None
    trainer.fit(model, data, ckpt_path=resume)
    os.makedirs(out, exist_ok=True)
    torch.save({**final_state(model, trainer.optimizers[0]), "global_step": trainer.global_step},
               os.path.join(out, f"final_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
