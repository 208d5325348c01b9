"""The Lightning example (``examples/lightning_tiny.py``) with a ``ZeroRedundancyOptimizer(AdamW)``
returned by ``configure_optimizers``; otherwise the same script (``--strategy leto`` under
``leto launch``, ``--strategy ddp`` for the reference). Saves ``RUN_DIR/final_rank<r>.pt``: every
param, the state dict of the AdamW over the params this rank owns (``zero.optim``), the step."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader

from leto_lightning.env import RUN_DIR
from leto_lightning.examples import lightning_tiny as tiny


class ZeroTinyLM(tiny.TinyTransformerLM):
    def configure_optimizers(self):
        hp = self.hparams
        opt = ZeroRedundancyOptimizer(self.parameters(), torch.optim.AdamW, lr=hp.lr, betas=(0.9, 0.95),
                                      weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        return [opt], [{"scheduler": sched, "interval": "step"}]


def main() -> None:
    args = tiny.parse_args()
    torch.set_num_threads(1)
    run_dir = os.environ.get(RUN_DIR, args.out)
    pl.seed_everything(0, workers=True, verbose=False)
    world = args.devices * args.num_nodes
    train = tiny.markov_data(args.batch_size * args.batches_per_epoch * world, 32, 32, seed=1)
    val = tiny.markov_data(32, 32, 32, seed=2)
    model = ZeroTinyLM(total_steps=args.max_steps)
    trainer = tiny.trainer_for(args, run_dir)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(val, batch_size=args.batch_size))
    zero = trainer.optimizers[0]
    assert isinstance(zero, ZeroRedundancyOptimizer)
    os.makedirs(run_dir, exist_ok=True)
    torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optimizer": zero.optim.state_dict(), "global_step": trainer.global_step},
               os.path.join(run_dir, f"final_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
