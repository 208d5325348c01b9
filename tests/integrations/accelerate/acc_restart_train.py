"""The Accelerate example's loop (``examples/accelerate_train.py``) with what a long job adds: an
evaluation every ``--eval-every`` optimizer steps under ``torch.no_grad()`` (a prepared loader
of its own, a gathered loss logged), ``accelerator.save_state`` every ``--save-every`` steps,
and ``--load-state DIR`` (``accelerator.load_state`` after ``prepare()``, then
``leto_resume()``). ``--plain`` runs it with ``accelerate.Accelerator`` (the reference).

Started by tests/integrations/accelerate/test_accelerate_restart.py under ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import torch

from leto_lightning.env import RUN_DIR
from leto_lightning.examples import accelerate_train as example


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser()
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--checkpoints", default="checkpoints")
    p.add_argument("--load-state", default=None)
    p.add_argument("--slow-after", type=int, default=0, help="from this optimizer step on, sleep 4x as long per "
                   "micro-step (time for a test to look at the trackers before the job ends; no numeric effect)")
    mine, rest = p.parse_known_args(argv)
    return mine, example.parse_args(rest)


def evaluate(accelerator: Any, model: Any, loader: Any, done: int, sleep: float) -> None:
    model.eval()
    total = torch.zeros(())
    with torch.no_grad():
        for inputs, targets in loader:
            logits, _ = model(inputs)
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            if sleep:
                time.sleep(sleep)  # stands for evaluation time
    accelerator.log({"eval_loss": accelerator.gather(total[None]).mean().item()}, step=done)
    model.train()


def main(argv: list[str]) -> None:
    mine, args = parse(argv)
    args.seed, args.weight_decay = 0, 0.1
    torch.set_num_threads(1)
    out = args.out or os.environ.get(RUN_DIR) or os.path.join("runs", "accelerate_restart")
    os.makedirs(out, exist_ok=True)
    cfg, loader = example.synthetic(args)
    tokens = torch.randint(0, cfg.vocab_size, (8, args.seq_len + 1), generator=torch.Generator().manual_seed(2))
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                                              batch_size=2)
    accelerator = example.build_accelerator(args, out)
    torch.manual_seed(args.seed)
    model = example.build_model(cfg, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.accumulation)
    steps = args.epochs * per_epoch
    total = steps * accelerator.num_processes
    warmup = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    model, opt, loader, eval_loader, sched = accelerator.prepare(model, opt, loader, eval_loader, sched)
    accelerator.init_trackers("accelerate_train")
    if mine.load_state:
        accelerator.load_state(mine.load_state)
    point = None if args.plain else accelerator.leto_resume()
    done = point.step if point is not None else 0  # optimizer steps taken
    model.train()
    for epoch in range(point.epoch if point is not None else 0, args.epochs):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                logits, aux = model(inputs)
                logits = torch.nn.functional.dropout(logits, p=args.dropout, training=True)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * aux
                accelerator.backward(loss)
                if args.sleep:
                    time.sleep(args.sleep * (4 if mine.slow_after and done >= mine.slow_after else 1))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                    accelerator.log({"loss": accelerator.gather(loss.detach()).mean().item(),
                                     "lr": sched.get_last_lr()[0], "epoch": epoch}, step=done)
                opt.step()
                sched.step()
                opt.zero_grad()
                if accelerator.sync_gradients:
                    done += 1
                    if mine.eval_every and done % mine.eval_every == 0:
                        evaluate(accelerator, model, eval_loader, done, args.sleep)
                    if mine.save_every and done % mine.save_every == 0:
                        accelerator.save_state(os.path.join(out, mine.checkpoints, f"step_{done}"))
    example.save_final(accelerator, model, opt, sched, None, out)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
