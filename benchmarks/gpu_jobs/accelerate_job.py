"""An Accelerate loop for the GPU check: the same small transformer LM, accumulation, clipping.

    python accelerate_job.py --plain --out ref/                    # plain accelerate.Accelerator
    leto launch --nproc-per-node 1 accelerate_job.py               # LetoAccelerator under Leto

Only the Accelerator class differs (``--plain``). Writes ``final_rank<r>.pt`` to
``$LETO_RUN_DIR`` or ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TinyLM, cosine, dataset, deterministic, final_state, loss_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="accelerate.Accelerator (the reference)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--out", default="accelerate_job_out")
    args = p.parse_args()
    deterministic()
    out = os.environ.get("LETO_RUN_DIR", args.out)
    if args.plain:
        from accelerate import Accelerator
    else:
        from leto_lightning.accelerate import LetoAccelerator as Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=args.cpu)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(args.max_steps * accelerator.num_processes, 4))
    g = torch.Generator().manual_seed(2)
    loader = torch.utils.data.DataLoader(dataset(16 * 2 * args.max_steps), batch_size=16, shuffle=True, generator=g)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    point = accelerator.leto_resume() if not args.plain else None
    done = point.step if point is not None else 0
    model.train()
    for _epoch in range(point.epoch if point is not None else 0, 100):
        for batch in loader:
            if done >= args.max_steps:
                break
            with accelerator.accumulate(model):
                loss = loss_of(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
                if accelerator.sync_gradients:
                    done += 1
        if done >= args.max_steps:
            break
    os.makedirs(out, exist_ok=True)
    torch.save({**final_state(accelerator.unwrap_model(model), opt), "step": done},
               os.path.join(out, f"final_rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
