"""The baselines' trainer: ``leto_lightning/examples/plain_ddp.py`` without Leto.

The same model (TinyLM, ``torch.manual_seed(0)``), the same batches, the same dropout-driven
RNG stream and the same ``torch.optim.AdamW(lr=3e-3, weight_decay=0.1)`` as the example Leto
runs, so both train the same thing (benchmarks/recovery.py checks the losses are
bit-identical) -- but with nothing of Leto: plain ``torch.distributed.init_process_group("gloo")``
through ``env://`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_USE_AGENT_STORE=True, as torchrun sets them: the driver hosts the TCPStore), one
``all_reduce`` per gradient, ``optimizer.step()``, and a checkpoint every K iterations:

* ``--checkpoint disk``: ``torch.save`` of the model and optimizer ``state_dict`` and the RNG
  state to RUN_DIR/checkpoints/rank<r>.pt (written to a temporary file, then renamed);
* ``--checkpoint shm`` (Gemini-style): the same state copied tensor by tensor into a POSIX
  shared-memory segment (``leto_lightning.retained.shm.SharedSegment``), double-buffered so a
  death during the copy leaves the previous checkpoint valid. The segment outlives the
  process; a restarted trainer attaches to it and copies the state back.

A fresh process resumes from whichever checkpoint exists. ``--spare`` makes a pre-warmed
spare (Gemini+): it imports torch and builds the model and optimizer, then waits on stdin
for one JSON line ``{"rank", "port", "gen"}`` before joining the process group.

It writes RUN_DIR/timeline_g<gen>_r<rank>.jsonl: one JSON object per milestone (``start``
before importing torch, ``imported``, ``go``, ``built``, ``loaded``, ``done`` after each
optimizer step, ``fault`` just before an injected SIGKILL) with ``time.time()`` stamps.
"""

from __future__ import annotations

import json
import os
import sys
import time

_T_START = time.time()  # before importing torch: the restart's import cost shows in the timeline

import argparse  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The very model and data of examples/plain_ddp.py (torch-only module: no Leto machinery imported).
from leto_lightning.models.tiny import TinyLM  # noqa: E402
from leto_lightning.models.tiny import rank_batch as batch  # noqa: E402

VOCAB = 97
HEADER_BYTES = 64  # int64[8]: valid slot, iteration of slot 0, iteration of slot 1, slot bytes


class Timeline:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.file = None
        self.buffered: list[dict] = []

    def open(self, gen: int, rank: int) -> None:
        self.file = open(os.path.join(self.run_dir, f"timeline_g{gen}_r{rank}.jsonl"), "a", buffering=1)
        for rec in self.buffered:
            self.file.write(json.dumps(rec) + "\n")
        self.buffered = []

    def mark(self, ev: str, **fields) -> None:
        rec = {"ev": ev, "t": fields.pop("t", time.time()), "pid": os.getpid(), **fields}
        if self.file is None:
            self.buffered.append(rec)
        else:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()


# -- in-memory (Gemini-style) checkpoint ------------------------------------------------------
def _adamw_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state in a fixed order; creates AdamW's state if absent
    (exactly what ``AdamW`` creates lazily: float32 ``step`` 0, zero moments)."""
    out = []
    for p in model.parameters():
        st = opt.state[p]
        if not st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out += [p.data, st["exp_avg"], st["exp_avg_sq"], st["step"]]
    return out


class ShmCheckpoint:
    """Double-buffered flat copy of params + AdamW state + RNG in one shared-memory segment."""

    def __init__(self, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        from leto_lightning.retained.shm import SharedSegment

        self.model, self.opt = model, opt
        shapes = [(p.numel() * 4) for p in model.parameters()]
        self.slot_bytes = sum(3 * n + 4 for n in shapes) + torch.get_rng_state().numel()
        try:
            self.seg = SharedSegment.attach(name)
        except FileNotFoundError:  # the first start of the job: one segment per rank, the driver unlinks it
            self.seg = SharedSegment.create(name, HEADER_BYTES + 2 * self.slot_bytes)
            self.seg.tensor[:HEADER_BYTES].view(torch.int64)[:3] = torch.tensor([-1, -1, -1])
        self.header = self.seg.tensor[:HEADER_BYTES].view(torch.int64)

    def _slot(self, i: int) -> torch.Tensor:
        start = HEADER_BYTES + i * self.slot_bytes
        return self.seg.tensor[start : start + self.slot_bytes]

    def _views(self, slot: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs, off = [], 0
        for t in _adamw_state(self.model, self.opt) + [torch.get_rng_state()]:
            n = t.numel() * t.element_size()
            pairs.append((t, slot[off : off + n].view(t.dtype).view(t.shape)))
            off += n
        return pairs

    def save(self, iteration: int) -> None:
        current = int(self.header[0])
        slot = 1 - current if current in (0, 1) else 0
        for src, dst in self._views(self._slot(slot)):
            dst.copy_(src)
        self.header[1 + slot] = iteration
        self.header[0] = slot  # the switch: one aligned 8-byte store

    def load(self) -> int | None:
        slot = int(self.header[0])
        if slot not in (0, 1):
            return None
        views = self._views(self._slot(slot))
        for dst, src in views[:-1]:
            with torch.no_grad():
                dst.copy_(src)
        torch.set_rng_state(views[-1][1].clone())
        return int(self.header[1 + slot])


# -- disk checkpoint ----------------------------------------------------------------------------
def disk_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"rank{rank}.pt")


def save_disk(path: str, model, opt, iteration: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": iteration,
                "rng": torch.get_rng_state()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_disk(path: str, model, opt) -> int | None:
    if not os.path.exists(path):
        return None
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    return ckpt["iteration"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=11)
    p.add_argument("--checkpoint", choices=("disk", "shm"), default="disk")
    p.add_argument("--shm-name", default="", help="segment name prefix for --checkpoint shm (+ '-r<rank>')")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per iteration (slow it down)")
    p.add_argument("--fail-at", type=int, default=-1, help="SIGKILL this process at this iteration")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-phase", choices=("compute", "update"), default="update",
                   help="compute: before the forward pass; update: when optimizer.step() starts")
    p.add_argument("--spare", action="store_true", help="pre-warmed spare: wait on stdin for a rank")
    p.add_argument("--wait-spares", type=int, default=0, help="the fault waits until this many spares are ready")
    args = p.parse_args()
    timeline = Timeline(args.run_dir)
    timeline.mark("start", t=_T_START)
    timeline.mark("imported")
    torch.set_num_threads(1)  # as plain_ddp.py: bit-identical across processes needs one thread count

    def build():
        torch.manual_seed(0)
        model = TinyLM(vocab=VOCAB, dim=args.dim)
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    if args.spare:
        model, opt = build()  # everything that needs no peers, ahead of time
        timeline.mark("prebuilt")
        open(os.path.join(args.run_dir, f"spare_ready_{os.getpid()}"), "w").close()
        line = sys.stdin.readline()
        if not line:
            return  # the driver is gone
        go = json.loads(line)
        os.environ.update(RANK=str(go["rank"]), MASTER_PORT=str(go["port"]), BENCH_GEN=str(go["gen"]))
        timeline.mark("go")
    rank, gen = int(os.environ["RANK"]), int(os.environ.get("BENCH_GEN", "0"))
    timeline.open(gen, rank)
    # env://; with TORCHELASTIC_USE_AGENT_STORE=True (set by the driver, as torchrun sets it) every rank is a
    # client of the TCPStore the driver hosts at MASTER_PORT
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    timeline.mark("pg")
    if not args.spare:
        model, opt = build()
    timeline.mark("built")
    if args.checkpoint == "shm":
        ckpt = ShmCheckpoint(f"{args.shm_name}-r{rank}", model, opt)
        start = ckpt.load()
        save = ckpt.save
    else:
        path = disk_path(args.run_dir, rank)
        start = load_disk(path, model, opt)
        save = lambda it: save_disk(path, model, opt, it)  # noqa: E731
    start = start or 0
    timeline.mark("loaded", iteration=start)

    def fault(phase: str, it: int) -> None:
        if it == args.fail_at and rank == args.fail_rank and phase == args.fail_phase:
            while sum(n.startswith("spare_ready_") for n in os.listdir(args.run_dir)) < args.wait_spares:
                time.sleep(0.05)  # steady state: strike once the spares are ready (Leto's "wait_shadows")
            timeline.mark("fault", iteration=it, phase=phase)
            os.kill(os.getpid(), signal.SIGKILL)

    state = {"it": start}
    opt.register_step_pre_hook(lambda *_: fault("update", state["it"]))
    world = dist.get_world_size()
    for it in range(start, args.iterations):
        state["it"] = it
        opt.zero_grad()
        fault("compute", it)
        x, y = batch(rank, it, VOCAB)
        logits = model(torch.nn.functional.dropout(torch.ones(1), 0.5).sum().mul(0).long() + x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if args.sleep:  # stands for compute time: inside the compute phase, redone on recompute
            time.sleep(args.sleep)
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad.div_(world)
        opt.step()
        timeline.mark("done", iteration=it, loss=loss.item())
        if args.checkpoint_every and (it + 1) % args.checkpoint_every == 0:
            save(it + 1)
            timeline.mark("saved", iteration=it + 1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
