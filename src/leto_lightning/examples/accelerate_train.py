"""A Hugging Face Accelerate training loop that survives failures in place.

    accelerate launch --config_file configs/accelerate/leto.yaml src/leto_lightning/examples/accelerate_train.py
    leto launch --nproc-per-node 2 src/leto_lightning/examples/accelerate_train.py
    torchrun --nproc-per-node 2 src/leto_lightning/examples/accelerate_train.py

The compact MoE transformer (``models/``) on a shuffled synthetic token set, AdamW, a cosine
schedule with warm-up, gradient accumulation, clipping, dropout and a tracker (a JSON-lines
file; ``--tensorboard`` / ``--wandb`` add Accelerate's own). ``--plain`` runs the same loop with
``accelerate.Accelerator`` (the reference). Deterministic on CPU: with and without failures the
final weights, optimizer state, LR and logged losses are bit-identical (``final_rank<r>.pt`` and
``losses.jsonl`` in the output directory).

``--ema`` keeps an exponential moving average of the weights, updated after ``opt.step()`` and
registered for checkpointing: user code after the step, which only the exact mode
(``--rollback-window``) redoes after a crash (docs/accelerate.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import torch
from accelerate.tracking import GeneralTracker

from leto_lightning.env import RUN_DIR
from leto_lightning.models.config import ModelConfig
from leto_lightning.models.moe_transformer import build_model


class JsonlTracker(GeneralTracker):
    """Accelerate tracker writing one JSON line per ``accelerator.log`` call (which runs on the
    main process only). Built before the accelerator, so it must not touch Accelerate's state
    (``PartialState()`` would be initialised here, without ``cpu=True``)."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: str) -> None:
        super().__init__(_blank=True)
        self.path = path
        self.file: Any = None

    @property
    def tracker(self) -> Any:
        return self.file

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if self.file is None:
            self.file = open(self.path, "a")
        self.file.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")
        self.file.flush()

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class EMA:
    """An exponential moving average of the weights (state outside retained memory)."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.shadow[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {n: t.clone() for n, t in self.shadow.items()}

    def load_state_dict(self, state: dict) -> None:
        for n, t in state.items():
            self.shadow[n].copy_(t)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plain", action="store_true", help="accelerate.Accelerator (the reference), not Leto's")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=64, help="sequences in the training set")
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--ema", action="store_true", help="an EMA of the weights after every opt.step()")
    p.add_argument("--rollback-window", action="store_true", help="Leto's exact mode (LetoConfig(rollback_window))")
    p.add_argument("--page-bytes", type=int, default=16384)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per micro-step (slow it down)")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--wandb", action="store_true", help="wandb (offline unless WANDB_MODE says otherwise)")
    p.add_argument("--out", default=None, help="output directory (default: $LETO_RUN_DIR, else runs/accelerate)")
    p.add_argument("--recipe", default=None, help="a resolved recipe (leto train --trainer accelerate): its model, "
                   "data, optimizer, accumulation, clipping, max_steps and seed replace the options above")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: epochs)")
    return p.parse_args(argv)


def from_recipe(args: argparse.Namespace) -> tuple[ModelConfig, Any]:
    """A recipe's model config and training loader; its settings go into ``args``."""
    from leto_lightning.models.config import load_recipe
    from leto_lightning.models.data import make_dataloaders

    recipe = load_recipe(args.recipe)
    args.accumulation = recipe.active.grad_accumulation
    args.lr, args.weight_decay = recipe.optimizer.lr, recipe.optimizer.weight_decay
    args.clip, args.max_steps = recipe.trainer.gradient_clip_val, recipe.trainer.max_steps
    args.seed = recipe.trainer.seed
    args.epochs = recipe.trainer.max_epochs if recipe.trainer.max_epochs > 0 else 1_000_000
    args.page_bytes, args.dropout = recipe.leto.page_bytes, 0.0
    return recipe.active.model, make_dataloaders(recipe)[0]


def synthetic(args: argparse.Namespace) -> tuple[ModelConfig, Any]:
    """The compact MoE model and a shuffled set of random token sequences."""
    cfg = ModelConfig(vocab_size=64, d_model=args.d_model, n_layers=args.layers, n_heads=2, n_kv_heads=2,
                      ffn_hidden=2 * args.d_model, expert_ffn_hidden=args.d_model, n_experts=4, top_k=2,
                      seq_len=args.seq_len)
    tokens = torch.randint(0, cfg.vocab_size, (args.samples, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return cfg, torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)


def build_accelerator(args: argparse.Namespace, out: str) -> Any:
    from accelerate import Accelerator

    trackers: list = [JsonlTracker(os.path.join(out, "losses.jsonl"))]
    if args.tensorboard:
        trackers.append("tensorboard")
    if args.wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        trackers.append("wandb")
    common = dict(gradient_accumulation_steps=args.accumulation, log_with=trackers, project_dir=out)
    if args.plain:  # without CUDA, cpu=True is what makes a MULTI_GPU launch train on gloo
        accelerator = Accelerator(cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
                                  **common)
        if accelerator.distributed_type == "MULTI_CPU" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            # an FSDP config (configs/accelerate/leto-fsdp2.yaml) on CPU: Accelerate dropped the
            # plugin; put its FSDP2 path back as LetoAccelerator does
            from accelerate.utils import FullyShardedDataParallelPlugin

            from leto_lightning.integrations.accelerate.fsdp2 import fsdp2_on_cpu

            fsdp2_on_cpu(accelerator, FullyShardedDataParallelPlugin())
        return accelerator
    from leto_lightning.accelerate import LetoAccelerator, LetoConfig

    leto = LetoConfig(page_bytes=args.page_bytes, data_pages=4, tier1_parity=1, tier2_parity=1,
                      record_bytes=1 << 20, rollback_window=args.rollback_window)
    return LetoAccelerator(leto=leto, **common)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.seed, args.weight_decay = 0, 0.1
    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    out = args.out or os.environ.get(RUN_DIR) or os.path.join("runs", "accelerate")
    os.makedirs(out, exist_ok=True)
    cfg, loader = from_recipe(args) if args.recipe else synthetic(args)
    accelerator = build_accelerator(args, out)
    torch.manual_seed(args.seed)
    model = build_model(cfg, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.accumulation)
    steps = args.max_steps if args.max_steps > 0 else args.epochs * per_epoch
    # Accelerate steps a prepared scheduler num_processes times per optimizer step (its batches
    # are num_processes times larger): the schedule counts in those units.
    total = steps * accelerator.num_processes
    warmup = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ema = EMA(accelerator.unwrap_model(model)) if args.ema else None
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    accelerator.init_trackers("accelerate_train")
    point = accelerator.leto_resume() if not args.plain else None
    train(args, accelerator, model, opt, loader, sched, ema, point, steps)
    save_final(accelerator, model, opt, sched, ema, out)
    accelerator.end_training()


def train(args: argparse.Namespace, accelerator: Any, model: Any, opt: Any, loader: Any, sched: Any,
          ema: EMA | None, point: Any, steps: int) -> None:
    """The loop; ``point``: where a resumed trainer continues (``leto_resume()``), else None."""
    model.train()
    done = point.step if point is not None else 0  # optimizer steps taken
    for epoch in range(point.epoch if point is not None else 0, args.epochs):
        for inputs, targets in loader:
            if done >= steps:
                return
            with accelerator.accumulate(model):
                logits, aux = model(inputs)
                logits = torch.nn.functional.dropout(logits, p=args.dropout, training=True)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * aux
                accelerator.backward(loss)
                if args.sleep:
                    time.sleep(args.sleep)  # stands for compute time: redone on recompute
                if accelerator.sync_gradients:
                    if args.clip:
                        accelerator.clip_grad_norm_(model.parameters(), args.clip)
                    # logged before the step: a recomputed step logs the same value again
                    accelerator.log({"loss": accelerator.gather(loss.detach()).mean().item(),
                                     "lr": sched.get_last_lr()[0], "epoch": epoch}, step=done)
                opt.step()
                sched.step()
                opt.zero_grad()
                if accelerator.sync_gradients:
                    done += 1
                    if ema is not None:
                        ema.update(accelerator.unwrap_model(model))


def save_final(accelerator: Any, model: Any, opt: Any, sched: Any, ema: EMA | None, out: str) -> None:
    inner = accelerator.unwrap_model(model)
    state = {"params": {n: _local(p.detach()) for n, p in inner.named_parameters()},
             "optimizer": _local(opt.state_dict()), "lr": sched.get_last_lr(), "step": accelerator.step,
             "ema": ema.state_dict() if ema is not None else None}
    torch.save(state, os.path.join(out, f"final_rank{accelerator.process_index}.pt"))


def _local(state: Any) -> Any:
    """Copies that own their storage; under FSDP2 a DTensor becomes its local shard (this rank's rows)."""
    if isinstance(state, torch.Tensor):
        return (state.to_local() if hasattr(state, "to_local") else state).detach().clone()
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_local(v) for v in state]
    return state


if __name__ == "__main__":
    main()
