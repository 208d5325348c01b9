"""A tiny training loop through Accelerate's FSDP2 plugin, with ``LetoAccelerator`` or (``--plain``)
``accelerate.Accelerator`` (tests/integrations/accelerate/test_accelerate_fsdp2.py).

Run as a script under ``accelerate launch --config_file configs/accelerate/leto-fsdp2.yaml``,
``leto launch`` or ``torchrun``, or called in forked ranks (``main(argv)``). Uneven shards (the
layers' dim 0, 5 and 3, do not divide by 2), a shuffled prepared loader, accumulation 2,
``accelerator.clip_grad_norm_`` on the DTensor gradients (every step clips), a prepared LR
schedule; ``--save-at``/``--stop-after``/``--load-state`` for a checkpoint restart (Accelerate's
FSDP2 ``save_state``/``load_state``: a distributed checkpoint), ``--reload-at`` to load the
``--save-at`` checkpoint back mid-run. Each rank writes
``losses_rank<r>.jsonl`` (a row per optimizer step, written before ``opt.step()``: a redone
step writes the same row again) and ``final_rank<r>.pt`` (the local real rows of every
parameter and of its AdamW state, the LR).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from leto_lightning.accelerate import LetoAccelerator, LetoConfig
from leto_lightning.integrations.accelerate.fsdp2 import fsdp2_on_cpu

ACCUMULATE = 2
MAX_NORM = 0.05
LETO = LetoConfig(page_bytes=64, data_pages=2, tier1_parity=1, tier2_parity=1, record_bytes=1 << 16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)  # 4 optimizer steps per epoch
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per micro-step (room for kills)")
    p.add_argument("--save-at", type=int, default=0, help="save_state after this optimizer step")
    p.add_argument("--stop-after", type=int, default=-1, help="stop after this optimizer step (a preemption)")
    p.add_argument("--load-state", default=None, help="load_state(DIR) after prepare()")
    p.add_argument("--reload-at", type=int, default=0, help="after this optimizer step, load the --save-at checkpoint")
    p.add_argument("--bf16", action="store_true", help="mixed_precision='bf16' (FSDP2 param_dtype bf16)")
    return p.parse_args(argv)


def build_accelerator(plain: bool, bf16: bool) -> Any:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    common = dict(fsdp_plugin=plugin, gradient_accumulation_steps=ACCUMULATE, mixed_precision="bf16" if bf16 else "no")
    if plain:  # Accelerate's own FSDP2 path, enabled on CPU as LetoAccelerator does it
        acc = Accelerator(cpu=True, **common)
        fsdp2_on_cpu(acc, plugin)
        return acc
    return LetoAccelerator(leto=LETO, **common)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    acc = build_accelerator(args.plain, args.bf16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if args.load_state:
        acc.load_state(args.load_state)
    point = None if args.plain else acc.leto_resume()
    done = point.step if point is not None else 0
    rows = open(os.path.join(args.out, f"losses_rank{acc.process_index}.jsonl"), "a")
    window: list[float] = []
    for _epoch in range(point.epoch if point is not None else 0, args.epochs):
        if done == args.stop_after:
            break
        for (x,) in loader:
            with acc.accumulate(model):
                loss = model(x).pow(2).mean()
                acc.backward(loss)
                window.append(loss.item())
                time.sleep(args.sleep)
                if acc.sync_gradients:
                    norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
                    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor before 1.16
                    rows.write(json.dumps({"step": done, "losses": window, "norm": norm.item()}) + "\n")
                    rows.flush()
                    window = []
                opt.step()
                sched.step()
                opt.zero_grad()
                done += acc.sync_gradients
            if acc.sync_gradients and done == args.save_at:
                acc.save_state(os.path.join(args.out, "checkpoints", f"step_{done}"))
            if acc.sync_gradients and done == args.reload_at:
                acc.load_state(os.path.join(args.out, "checkpoints", f"step_{args.save_at}"))
            if done == args.stop_after:
                break
    rows.close()
    if done != args.stop_after:
        torch.save(final_state(acc, model, opt), os.path.join(args.out, f"final_rank{acc.process_index}.pt"))
    acc.end_training()


def final_state(acc: Any, model: torch.nn.Module, opt: Any) -> dict:
    """The local real rows of every parameter and of its AdamW state (a retained alias is the
    padded shard: narrowed to the real rows, its padding must be zero), the LR; retained runs
    also say whether params and grads are views into the store."""
    named = list(model.named_parameters())
    torch_opt = opt.optimizer
    out: dict = {"params": {n: p.to_local().clone() for n, p in named}, "state": {},
                 "lr": torch_opt.param_groups[0]["lr"], "padding_zero": True}
    bound = getattr(acc, "leto_fsdp2", None)
    keys = [p for _, p in named] if bound is None else [a for g in torch_opt.param_groups for a in g["params"]]
    for (name, p), key in zip(named, keys):
        rows = p.to_local().shape[0]
        state = {}
        for k, v in torch_opt.state[key].items():
            v = v.to_local() if hasattr(v, "to_local") else v
            if bound is not None and v.dim():
                out["padding_zero"] &= bool((v[rows:] == 0).all())
                v = v[:rows]
            state[k] = v.clone()
        out["state"][name] = state
    if bound is not None:
        data = bound.store.data
        lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
        out["in_store"] = all(lo <= p.to_local().data_ptr() < hi and lo <= p.grad.to_local().data_ptr() < hi
                              for _, p in named)
        out["iteration"] = bound.iteration
    return out


if __name__ == "__main__":
    main()
