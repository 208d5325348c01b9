"""Fault-free update overhead: the analog of the paper's Table 1 (docs/benchmarks/update-overhead.md).

Mean iteration time, split into a compute phase (zero_grad + forward + backward) and an
update phase, for four model updaters on identical models fed identical batches:

* reference -- plain ``torch.optim.AdamW.step()`` on ordinary tensors (no crash consistency);
* sync snapshotting -- before every update, copy every parameter and the optimizer state
  (``exp_avg``, ``exp_avg_sq``, ``step``) into a preallocated host buffer in POSIX shared
  memory (so it would survive the trainer), then ``step()``;
* async snapshotting -- the same copy on a background thread overlapped with the next
  iteration's compute; it is joined before the next update and any wait counts as update;
* RMU + RMP -- ``RetainedOptimizer`` (params, grads and AdamW state are views into retained
  shared memory; ``step()`` runs chunk transactions: grad checksums + grad parity, then per
  chunk undo copy -> AdamW math -> tier-1 parity delta -> checksums -> commit mark).

All four run in the same process, interleaved: rounds of ``--round-iters`` iterations of each
variant in rotation (the starting variant rotates too), so machine noise hits all of them alike.
The first ``--warmup`` iterations of each variant are not counted. After timing, the final
weights and optimizer state of every variant are compared with the reference's
(``torch.equal``): RMU must be bit-identical to ``optimizer.step()``.

The model is the package's decoder-only transformer (``leto_lightning.models.moe_transformer``,
dense by default; ``--experts`` makes it an MoE) sized so the reference's compute:update ratio
is in the range of real LLM training (the paper's OLMoE: 12566 ms / 47 ms = 267:1).

    python benchmarks/update_overhead.py                      # defaults: ~6 min on 2 cores
    python benchmarks/update_overhead.py --page-kib 256,1024 --profile-rmu 5   # the run in the doc, ~8 min
    python benchmarks/update_overhead.py --iterations 3 --warmup 1 --batch 2 --seq 64   # smoke test, seconds

Defaults: 2.56M-parameter dense model, 24 x 512 tokens per batch, one intra-op thread: the
reference's compute:update is about 200:1 on a 2-vCPU Xeon. One thread because on a shared
2-core machine a 2-thread OpenMP region waits for its descheduled partner, which inflates the
many small per-chunk operations of the update far more than the large matmuls of compute.
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import platform
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from leto_lightning import new_job_id
from leto_lightning.models.config import ModelConfig, count_parameters
from leto_lightning.models.data import MarkovChain
from leto_lightning.models.moe_transformer import build_model
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import SharedSegment, segment_name
from leto_lightning.updater.retained_optimizer import RetainedOptimizer

PAPER = {  # Table 1 of the paper (OLMoE, ms): compute, update, total, overhead
    "reference": (12566, 47, 12613, None),
    "sync": (13424, 82, 13506, 7.1),
    "async": (13372, 82, 13454, 6.7),
    "rmu": (12572, 111, 12683, 0.6),
}
AUX_LOSS_WEIGHT = 0.01


# -- the variants -------------------------------------------------------------------------
class Reference:
    """Plain ``optimizer.step()``; ``zero_grad()`` (set to None) before the compute phase."""

    key = "reference"
    label = "reference (plain optimizer.step())"
    paper = "reference"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def compute(self, tokens: torch.Tensor) -> float:
        self.zero_grad()
        loss = lm_loss(self.model, tokens)
        loss.backward()
        return float(loss.detach())

    def update(self) -> None:
        self.optimizer.step()

    def close(self) -> None:
        pass


class SyncSnapshot(Reference):
    """Copy params + AdamW state into a preallocated POSIX shared-memory buffer, then step."""

    key = "sync"
    label = "sync snapshotting"
    paper = "sync"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, job_id: str) -> None:
        super().__init__(model, optimizer)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.numel = sum(p.numel() for p in self.params)
        # float32 words: params | exp_avg | exp_avg_sq | one step counter per param
        nbytes = 4 * (3 * self.numel + len(self.params))
        self.segment = SharedSegment.create(segment_name(job_id, f"{self.key}-snapshot"), nbytes)
        self.buffer = self.segment.tensor.view(torch.float32)
        self.buffer.zero_()  # fault the pages in now, not in the first timed copy
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._n_state = -1

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) for everything that exists now (AdamW creates state lazily)."""
        n_state = sum(len(self.optimizer.state.get(p, {})) for p in self.params)
        if n_state != self._n_state:
            out, offset = [], 0
            for i, p in enumerate(self.params):
                n = p.numel()
                out.append((p.detach(), self.buffer[offset : offset + n].view_as(p)))
                state = self.optimizer.state.get(p, {})
                for k, kind in enumerate(("exp_avg", "exp_avg_sq"), start=1):
                    if kind in state:
                        dst = self.buffer[k * self.numel + offset : k * self.numel + offset + n]
                        out.append((state[kind], dst.view_as(p)))
                if "step" in state:
                    out.append((state["step"].reshape(1), self.buffer[3 * self.numel + i : 3 * self.numel + i + 1]))
                offset += n
            self._pairs, self._n_state = out, n_state
        return self._pairs

    def snapshot(self, pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        for src, dst in pairs if pairs is not None else self.pairs():
            dst.copy_(src)

    def update(self) -> None:
        self.snapshot()
        self.optimizer.step()

    def close(self) -> None:
        self._pairs = []
        self.buffer = None
        self.segment.close()
        self.segment.unlink()


class AsyncSnapshot(SyncSnapshot):
    """The same copy on a background thread, overlapped with the next iteration's compute.

    The copy of the state produced by update t is started at the beginning of iteration t+1
    (in a continuous loop that is "right after the update"; starting it only there keeps it from
    overlapping another variant's compute at a round boundary). It is joined before update t+1;
    the wait, if any, is counted in the update phase.
    """

    key = "async"
    label = "async snapshotting"
    paper = "async"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._thread: threading.Thread | None = None

    def compute(self, tokens: torch.Tensor) -> float:
        pairs = self.pairs()  # built here, not in the thread: the thread only copies
        self._thread = threading.Thread(target=self.snapshot, args=(pairs,), daemon=True)
        self._thread.start()
        return super().compute(tokens)

    def update(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.optimizer.step()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        super().close()


class RetainedUpdate(Reference):
    """``RetainedOptimizer``: retained params/grads/state, update as chunk transactions."""

    paper = "rmu"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RetainedConfig,
                 tag: str = "") -> None:
        super().__init__(model, optimizer)
        self.key = "rmu" + (f"-{tag}" if tag else "")
        self.label = "RMU + RMP" + (f" ({tag} pages)" if tag else " (chunk transactions)")
        self.config = config
        self.ro = RetainedOptimizer.create(optimizer, config)

    def zero_grad(self) -> None:
        self.ro.zero_grad()

    def update(self) -> None:
        self.ro.step()

    def close(self) -> None:
        self.ro.store.close()
        self.ro.store.unlink()


class UncheckedUpdate(RetainedUpdate):
    """``--integrity-ab``: the same chunk transactions with the integrity metadata switched off --
    no metadata checksum words, no mirror copy, no second undo header, one progress-record copy:
    the update as it was before those checks. Timed beside RMU, the difference is their cost.
    (Not crash-safe: only for timing; the math, and so bit-identity, is unchanged.)"""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RetainedConfig) -> None:
        super().__init__(model, optimizer, config)
        self.key, self.label = "rmu-unchecked", "RMU + RMP without the integrity metadata (before)"
        meta = self.ro.txn.meta
        for name in ("seal_chunk", "mirror_chunk", "seal_grads"):
            setattr(meta, name, lambda *a: None)
        heads = meta._heads
        meta.write_header = lambda words: heads[0].__setitem__(slice(0, len(words)), words)  # one plain copy
        record = self.ro.store.record
        record._pairs = tuple(pair[:1] for pair in record._pairs)  # each entry written once


class RollbackUpdate(RetainedUpdate):
    """``--rollback-window``: what manual optimization uses -- one whole-state transaction per
    step (torch's own ``step()`` between a full undo copy and the parity deltas) and a seal."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: RetainedConfig) -> None:
        Reference.__init__(self, model, optimizer)
        self.key, self.label = "rmu-manual", "RMU + RMP (manual optimization: rollback window)"
        self.config = config
        self.ro = RetainedOptimizer.create(optimizer, config, rollback_window=True)

    def update(self) -> None:
        self.ro.step()
        self.ro.seal(None)


# -- model and data -----------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        ffn_hidden=args.ffn,
        expert_ffn_hidden=args.ffn if args.experts else 0,
        n_experts=args.experts,
        top_k=args.top_k if args.experts else 0,
        seq_len=args.seq,
    )


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits, aux = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return ce + AUX_LOSS_WEIGHT * aux


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # foreach/fused left at torch's defaults: on CPU that is the single-tensor path
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def make_batches(cfg: ModelConfig, args: argparse.Namespace) -> list[torch.Tensor]:
    chain = MarkovChain(cfg.vocab_size, seed=args.seed)
    return [chain.sample(args.batch, cfg.seq_len + 1, seed=args.seed * 1000 + i) for i in range(args.data_batches)]


# -- timing -------------------------------------------------------------------------------
def run_interleaved(variants: list[Reference], batches: list[torch.Tensor], warmup: int, iterations: int,
                    round_iters: int, progress: Callable[[str], None]) -> dict[str, list[tuple[int, float, float]]]:
    """Per variant, (round, compute seconds, update seconds) of its measured iterations."""
    total = warmup + iterations
    done = {v.key: 0 for v in variants}
    times: dict[str, list[tuple[int, float, float]]] = {v.key: [] for v in variants}
    n_rounds = math.ceil(total / round_iters)
    clock = time.perf_counter
    for r in range(n_rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            for _ in range(min(round_iters, total - done[v.key])):
                tokens = batches[done[v.key] % len(batches)]
                t0 = clock()
                v.compute(tokens)
                t1 = clock()
                v.update()
                t2 = clock()
                if done[v.key] >= warmup:
                    times[v.key].append((r, t1 - t0, t2 - t1))
                done[v.key] += 1
        progress(f"  round {r + 1}/{n_rounds}: " + ", ".join(
            f"{v.key} {1e3 * times[v.key][-1][1]:.0f}+{1e3 * times[v.key][-1][2]:.1f} ms" if times[v.key]
            else f"{v.key} warm-up" for v in variants))
    return times


INTEGRITY_ROW = "metadata checksums, mirror, 2 undo headers (inside the rows above)"


def profile_rmu(rmu: RetainedUpdate, batches: list[torch.Tensor], steps: int) -> list[tuple[str, float]]:
    """Mean ms per ``ro.step()`` in each sub-step (timer wrappers; indented rows are parts of the row above).

    Wraps ``ChunkTransactions`` methods and the functions ``transaction.py`` imported; any that a
    later version renames are skipped.
    """
    from leto_lightning.updater import transaction as T

    txn = rmu.ro.txn
    acc: dict[str, float] = collections.defaultdict(float)
    restore: list[tuple[object, str, object, bool]] = []
    where = {"in_prepare": False}

    def wrap(obj: object, name: str, label: Callable[[], str] | str) -> None:
        if not hasattr(obj, name):
            return
        original = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                acc[label() if callable(label) else label] += time.perf_counter() - t

        restore.append((obj, name, original, name in getattr(obj, "__dict__", {})))
        setattr(obj, name, timed)

    def protect_grads_flagged(original=getattr(txn, "protect_grads", None)):  # noqa: B008  (bound once, at wrap time)
        def run(*a, **k):
            where["in_prepare"] = True
            try:
                return original(*a, **k)
            finally:
                where["in_prepare"] = False
        return run

    if hasattr(txn, "protect_grads"):
        restore.append((txn, "protect_grads", txn.protect_grads, False))
        txn.protect_grads = protect_grads_flagged()
    for name, label in [("prepare", "prepare (total)"), ("protect_grads", "  grad checksums + grad parity"),
                        ("update_chunks", "update_chunks (total)"), ("_save_undo", "  undo copy"),
                        ("_pieces", "  build chunk views"), ("_tier1_delta", "  tier-1 parity delta"),
                        ("_tier2_delta", "  tier-2 parity delta"), ("commit", "commit (record)")]:
        wrap(txn, name, label)
    wrap(T, "apply_update", "  AdamW math")
    wrap(T, "checksum", lambda: "    grad checksums" if where["in_prepare"] else "  page checksums")
    wrap(rmu.ro.store.record, "write", "progress-record writes (in prepare/commit)")
    meta = getattr(txn, "meta", None)  # the integrity metadata (checksum words, mirror, two undo headers)
    for name in ("seal_chunk", "mirror_chunk", "write_header", "seal_grads"):
        wrap(meta, name, INTEGRITY_ROW)
    total = 0.0
    try:
        for i in range(steps):
            rmu.compute(batches[i % len(batches)])
            t = time.perf_counter()
            rmu.update()
            total += time.perf_counter() - t
    finally:
        for obj, name, original, in_instance in reversed(restore):
            if in_instance or obj is T:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
    ms = {label: 1e3 * v / steps for label, v in acc.items()}
    order = ["prepare (total)", "  grad checksums + grad parity", "    grad checksums", "update_chunks (total)",
             "  undo copy", "  build chunk views", "  AdamW math", "  tier-1 parity delta", "  tier-2 parity delta",
             "  page checksums", "commit (record)", "progress-record writes (in prepare/commit)", INTEGRITY_ROW]
    rows = [("ro.step() (total)", 1e3 * total / steps)] + [(k, ms[k]) for k in order if k in ms]
    if "update_chunks (total)" in ms:
        parts = sum(ms.get(k, 0.0) for k in order[4:10])
        rows.insert(rows.index(("update_chunks (total)", ms["update_chunks (total)"])) + 1 + sum(
            1 for k in order[4:10] if k in ms), ("  rest (chunk loop, marks, fault points)",
                                                 ms["update_chunks (total)"] - parts))
    return rows


def compare(a: Reference, b: Reference) -> tuple[bool, bool]:
    """(weights equal, optimizer state equal) with torch.equal, parameter by parameter."""
    pa = [p for g in a.optimizer.param_groups for p in g["params"]]
    pb = [p for g in b.optimizer.param_groups for p in g["params"]]
    weights = len(pa) == len(pb) and all(torch.equal(x.detach(), y.detach()) for x, y in zip(pa, pb))
    state = True
    for x, y in zip(pa, pb):
        sx, sy = a.optimizer.state[x], b.optimizer.state[y]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            state &= torch.equal(sx[k].float(), sy[k].float())
    return weights, state


# -- report -------------------------------------------------------------------------------
def mean_ms(values: list[float]) -> float:
    return 1e3 * statistics.fmean(values)


def report(variants: list[Reference], times: dict[str, list[tuple[int, float, float]]],
           out: Callable[[str], None]) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for v in variants:
        ts = times[v.key]
        comp, upd = [c for _, c, _ in ts], [u for _, _, u in ts]
        tot = [c + u for _, c, u in ts]
        rows[v.key] = {
            "compute": mean_ms(comp), "update": mean_ms(upd), "total": mean_ms(tot),
            "compute_sem": 1e3 * statistics.stdev(comp) / math.sqrt(len(comp)) if len(comp) > 1 else 0.0,
            "update_median": 1e3 * statistics.median(upd), "total_median": 1e3 * statistics.median(tot),
        }
    ref = rows["reference"]
    for row in rows.values():
        row["overhead"] = 100 * (row["total"] / ref["total"] - 1)
        row["update_only"] = 100 * (row["update"] - ref["update"]) / ref["total"]
    width = max(34, *(len(v.label) for v in variants))
    out(f"{'model updater':{width}s} {'compute ms':>11s} {'update ms':>10s} {'total ms':>10s} {'overhead':>9s}"
        f" {'upd. only':>9s}   paper: total (overhead)")
    for v in variants:
        row, p = rows[v.key], PAPER[v.paper]
        paper = f"{p[2]} ms" + (f" (+{p[3]}%)" if p[3] is not None else "")
        cols = ["", ""] if v.key == "reference" else [f"{row['overhead']:+.2f}%", f"{row['update_only']:+.2f}%"]
        out(f"{v.label:{width}s} {row['compute']:11.1f} {row['update']:10.2f} {row['total']:10.1f} "
            f"{cols[0]:>9s} {cols[1]:>9s}   {paper}")
    out("")
    out("overhead  = mean total / reference mean total - 1 (the paper's column; includes compute-phase noise)")
    out("upd. only = (mean update - reference mean update) / reference mean total (the update phase alone)")
    out("compute-phase noise, standard error of the mean: " + ", ".join(
        f"{k} ±{row['compute_sem']:.1f} ms" for k, row in rows.items()))
    out("medians: " + ", ".join(f"{k} {row['total_median']:.1f} ms total / {row['update_median']:.2f} ms update"
                                 for k, row in rows.items()))
    out(f"reference compute:update = {ref['compute'] / ref['update']:.0f}:1 (paper, OLMoE: 12566/47 = 267:1)")
    for v in variants:
        if isinstance(v, RetainedUpdate):
            out(f"update-phase ratio {v.key}/reference = {rows[v.key]['update'] / ref['update']:.2f}x "
                f"(paper: 111/47 = {111 / 47:.2f}x)")
    out(f"update-phase ratio sync/reference = {rows['sync']['update'] / ref['update']:.2f}x, "
        f"async/reference = {rows['async']['update'] / ref['update']:.2f}x (paper: 82/47 = {82 / 47:.2f}x)")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Fault-free iteration time (compute / update) of plain optimizer.step(), sync and async "
                    "snapshotting to shared memory, and RMU + RMP chunk transactions: the paper's Table 1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model and data (the compute:update ratio follows from these)")
    m.add_argument("--d-model", type=int, default=192, help="model width")
    m.add_argument("--layers", type=int, default=4, help="transformer blocks")
    m.add_argument("--heads", type=int, default=3, help="attention heads (no GQA)")
    m.add_argument("--ffn", type=int, default=512, help="SwiGLU hidden width (per expert with --experts)")
    m.add_argument("--vocab", type=int, default=2048, help="vocabulary size (embedding and untied LM head)")
    m.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: dense model)")
    m.add_argument("--top-k", type=int, default=2, help="experts per token with --experts")
    m.add_argument("--batch", type=int, default=24, help="sequences per batch")
    m.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    m.add_argument("--data-batches", type=int, default=4, help="distinct batches cycled through")
    m.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (weight decay 0.1)")
    m.add_argument("--seed", type=int, default=0, help="model init and data seed")
    t = p.add_argument_group("timing")
    t.add_argument("--rollback-window", action="store_true",
                   help="also time manual optimization's update (whole-state transaction + seal)")
    t.add_argument("--integrity-ab", action="store_true",
                   help="also time RMU with its integrity metadata (checksum words, mirror, second undo header and "
                        "record copy) switched off: the cost of those checks, interleaved in the same run")
    t.add_argument("--iterations", type=int, default=30, help="measured iterations per variant")
    t.add_argument("--warmup", type=int, default=3, help="uncounted iterations per variant first")
    t.add_argument("--round-iters", type=int, default=2, help="iterations of one variant per rotation turn")
    t.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (torch.set_num_threads); 1 is stable on a shared 2-core box")
    t.add_argument("--profile-rmu", type=int, default=0, metavar="N",
                   help="after timing, N more RMU iterations with the update's sub-steps timed")
    r = p.add_argument_group("retained memory (variant RMU + RMP)")
    r.add_argument("--page-kib", type=str, default="1024",
                   help="page size, KiB; a comma list (e.g. 256,1024) runs one RMU variant per size, interleaved")
    r.add_argument("--chunk-pages", type=int, default=1, help="pages per region in one chunk transaction")
    r.add_argument("--data-pages", type=int, default=8, help="D, data pages per tier-1 group")
    r.add_argument("--tier1-parity", type=int, default=1, help="H1, tier-1 parity pages per group")
    args = p.parse_args(argv)
    try:
        args.page_kib = [int(x) for x in str(args.page_kib).split(",") if x.strip()]
    except ValueError:
        p.error(f"--page-kib {args.page_kib!r}: expected integers separated by commas")
    if not args.page_kib or min(args.page_kib) < 1 or len(set(args.page_kib)) != len(args.page_kib):
        p.error("--page-kib: give one or more distinct positive sizes")
    if args.iterations < 2 or args.warmup < 0 or args.round_iters < 1 or args.threads < 1:
        p.error("need --iterations >= 2, --warmup >= 0, --round-iters >= 1, --threads >= 1")
    return args


def retained_config(args: argparse.Namespace, page_kib: int) -> RetainedConfig:
    return RetainedConfig(page_bytes=page_kib * 1024, chunk_pages=args.chunk_pages, data_pages=args.data_pages,
                          tier1_parity=args.tier1_parity, tier2_parity=0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = print
    cfg = model_config(args)
    total_params, active_params = count_parameters(cfg)
    rcfgs = [retained_config(args, kib) for kib in args.page_kib]  # validated before anything is allocated
    batches = make_batches(cfg, args)
    job_id = new_job_id()

    out(f"torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} intra-op "
        f"thread(s) (torch.set_num_threads({args.threads}))")
    kind = f"MoE ({cfg.n_experts} experts, top-{cfg.top_k})" if cfg.n_experts else "dense"
    out(f"model: {kind} decoder-only transformer (leto_lightning.models.moe_transformer), d_model={cfg.d_model}, "
        f"layers={cfg.n_layers}, heads={cfg.n_heads}, ffn={args.ffn}, vocab={cfg.vocab_size}: "
        f"{total_params / 1e6:.2f}M params ({active_params / 1e6:.2f}M active), fp32, AdamW (torch default: "
        "single-tensor path on CPU)")
    out(f"data: {args.batch} x {cfg.seq_len} tokens per batch ({args.batch * cfg.seq_len} tokens), "
        f"{args.data_batches} distinct Markov-chain batches cycled")
    out(f"timing: {args.iterations} measured iterations per variant after {args.warmup} warm-up, rounds of "
        f"{args.round_iters} iterations per variant in rotation; gc disabled while timing")

    variants: list[Reference] = []

    def new_pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(cfg, seed=args.seed)  # identical init for every variant
        return model, make_optimizer(model, args)

    try:
        variants.append(Reference(*new_pair()))
        variants.append(SyncSnapshot(*new_pair(), job_id))
        variants.append(AsyncSnapshot(*new_pair(), job_id))
        tagged = len(rcfgs) > 1
        for kib, rcfg in zip(args.page_kib, rcfgs):
            tag = (f"{kib // 1024} MiB" if kib % 1024 == 0 else f"{kib} KiB") if tagged else ""
            variants.append(RetainedUpdate(*new_pair(), rcfg, tag=tag))
        if args.integrity_ab:
            variants.append(UncheckedUpdate(*new_pair(), rcfgs[0]))
        if args.rollback_window:
            variants.append(RollbackUpdate(*new_pair(), rcfgs[0]))
        rmus = [v for v in variants if isinstance(v, RetainedUpdate) and not isinstance(v, UncheckedUpdate)]
        for v in rmus:
            c = v.config
            code = v.ro.txn.codes.tier1
            out(f"retained ({v.key}): RetainedConfig(page_bytes={c.page_bytes // 1024} KiB, "
                f"chunk_pages={c.chunk_pages}, "
                f"data_pages={c.data_pages}, tier1_parity={c.tier1_parity}, tier2_parity={c.tier2_parity}), tier-1 "
                f"code {code if code is not None else 'none (H1=0)'}")
            out(f"  layout: {v.ro.layout.describe()}")
        out(f"snapshot buffers: {variants[1].segment.nbytes / 2**20:.1f} MiB each in /dev/shm "
            f"({variants[1].segment.name}, {variants[2].segment.name})")
        out("")

        gc.collect()
        gc.disable()
        try:
            started = time.perf_counter()
            times = run_interleaved(variants, batches, args.warmup, args.iterations, args.round_iters, out)
            elapsed = time.perf_counter() - started
        finally:
            gc.enable()
        out(f"(timed loop: {elapsed:.0f} s)")
        out("")
        rows = report(variants, times, out)
        if args.integrity_ab:
            checked, unchecked = rows[rmus[0].key], rows["rmu-unchecked"]
            added = checked["update"] - unchecked["update"]
            out(f"integrity checks: {rmus[0].key} - rmu-unchecked = {added:+.2f} ms per update "
                f"({100 * added / rows['reference']['total']:+.3f}% of the reference iteration; medians "
                f"{checked['update_median'] - unchecked['update_median']:+.2f} ms)")

        out("")
        n = args.warmup + args.iterations
        for v in rmus:
            weights, state = compare(variants[0], v)
            out(f"bit-identical: {weights and state}  ({v.key} vs reference after {n} iterations from the same "
                f"init on the same data: weights {weights}, exp_avg/exp_avg_sq/step {state})")
        for v in variants[1:3]:
            w, st = compare(variants[0], v)
            out(f"  {v.key} vs reference: weights {w}, optimizer state {st}")

        for v in rmus if args.profile_rmu else []:
            out("")
            out(f"{v.key} update sub-steps, mean ms per step over {args.profile_rmu} extra iterations "
                "(timer wrappers add a little; indented rows are parts of the row above):")
            for label, ms in profile_rmu(v, batches, args.profile_rmu):
                out(f"  {label:44s} {ms:8.2f}")
    finally:
        for v in variants:
            v.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
