"""The device check's measurements on one GPU: the update of a ~1B-parameter AdamW model, a
whole training iteration at a realistic step time, CUDA IPC attach, the torch parity engine.

Imported by ``benchmarks/gpu_check.py`` (which prints the table); each function returns table
rows ``(what, value, unit)``. Nothing here runs without a CUDA device.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.utils.checkpoint

MiB = 1 << 20
GB = 1e9
Row = tuple[str, float | str, str]


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` with the device drained before and after each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def retained_config():
    from leto_lightning.retained.config import RetainedConfig

    # 4 MiB pages, 16 pages per kind and chunk: a 1B model's update is ~64 chunks of 192 MiB
    return RetainedConfig(page_bytes=4 * MiB, chunk_pages=16, data_pages=8, tier1_parity=1)


# -- CUDA IPC --------------------------------------------------------------------------------
def measure_attach(manager) -> list[Row]:
    from leto_lightning.retained.backends.cuda_ipc import CudaSegment

    t0 = time.perf_counter()
    torch.empty(1, device="cuda")  # this process's CUDA context (a shadow has it before it attaches)
    context = time.perf_counter() - t0
    name = f"leto-gpucheck{os.getpid()}-attach"
    t0 = time.perf_counter()
    manager.alloc(name, 1 << 30, 0)
    alloc = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        seg = CudaSegment.attach(name, manager.address)
        seg.tensor[:16].fill_(1)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        seg.close()
        del seg
        t0 = time.perf_counter()
        again = CudaSegment.attach(name, manager.address)
        again.tensor[:16].sum().item()
        second = time.perf_counter() - t0
        again.close()
        del again
    finally:
        manager.free(name)
    return [("ipc: this process's CUDA context init", context * 1e3, "ms (not part of an attach)"),
            ("ipc: manager alloc 1 GiB (zero-filled)", alloc * 1e3, "ms"),
            ("ipc: attach 1 GiB buffer, first", first * 1e3, "ms (socket + cudaIpcOpenMemHandle)"),
            ("ipc: attach again after close", second * 1e3, "ms")]


# -- the update of a ~1B-parameter model -------------------------------------------------------
def _mlp(n_params: int, width: int = 4096) -> torch.nn.Module:
    layers = max(1, round(n_params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()


def measure_update(n_params: int, manager, repeats: int = 5) -> list[Row]:
    """AdamW's step on ~``n_params`` fp32 parameters: torch's default (foreach) against the
    same step as chunk transactions on retained device memory; the memory each takes."""
    from leto_lightning.env import ProcessSettings
    from leto_lightning.updater.retained_optimizer import RetainedOptimizer

    x = torch.randn(16, 4096, device="cuda")
    model = _mlp(n_params)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(x).square().mean().backward()
    torch.cuda.reset_peak_memory_stats()
    plain = timed(opt.step, repeats)
    plain_bytes = torch.cuda.max_memory_allocated()  # params + grads + moments (+ the step's temporaries)
    del model, opt
    torch.cuda.empty_cache()

    model = _mlp(n_params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(x).square().mean().backward()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    ro = RetainedOptimizer.create(opt, retained_config(), settings=ProcessSettings.from_env())
    torch.cuda.synchronize()
    create = time.perf_counter() - t0
    torch.cuda.empty_cache()
    after_bind = torch.cuda.memory_allocated()  # the model's own tensors are views now: freed here
    model(x).square().mean().backward()  # gradients into the retained views
    torch.cuda.reset_peak_memory_stats()
    own_before = torch.cuda.memory_allocated()
    retained = timed(ro.step, repeats)
    own_peak = torch.cuda.max_memory_allocated() - own_before  # what the transactions allocate in the trainer
    store = ro.store
    held = manager.stats()
    data, undo = store.segments["data"].nbytes, store.segments["undo"].nbytes
    parity = store.segments["parity1"].nbytes
    state_bytes = 4 * n * 4  # params, grads, exp_avg, exp_avg_sq (fp32)
    store.close()
    store.unlink()
    del model, opt, ro
    torch.cuda.empty_cache()
    return [
        (f"update: AdamW default (foreach) step, {n / 1e9:.2f}B fp32 params", plain * 1e3, "ms"),
        ("update: Leto chunk transactions (undo, math, parity, hashes, marks)", retained * 1e3, "ms"),
        ("update: ratio Leto / torch", retained / plain, "x"),
        ("update: store create + bind + encode", create, "s (once per job)"),
        ("memory: plain training state on the device", plain_bytes / GB, "GB"),
        ("memory: retained data in the state manager", data / GB, f"GB (params+grads+moments {state_bytes / GB:.2f})"),
        ("memory: undo buffer (the chunk in flight)", undo / GB, "GB (state manager)"),
        ("memory: trainer's own allocation after binding", after_bind / GB,
         f"GB (was {base / GB:.2f} before: params and grads are views now)"),
        ("memory: trainer's peak extra during a step", own_peak / GB, "GB (parity rows, hash temporaries)"),
        ("memory: state manager allocated (stats)", held["allocated"] / GB, "GB"),
        ("memory: host parity (tier 1)", parity / GB, f"GB = {parity / data:.3f} of retained (H1/D = 0.125)"),
    ]


# -- a whole iteration at a realistic step time -------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class _GPT(torch.nn.Module):
    def __init__(self, vocab: int = 32768, d: int = 2048, layers: int = 18, heads: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln(x))


def measure_iteration(manager, micro_batches: int = 8, batch: int = 8, seq: int = 2048,
                      timed_iterations: int = 2) -> list[Row]:
    """A ~1B GPT (fp32 master weights, bf16 autocast, gradient accumulation over ``micro_batches``
    of ``batch x seq`` tokens): whole iterations with torch's AdamW and with Leto's."""
    from leto_lightning.env import ProcessSettings
    from leto_lightning.updater.retained_optimizer import RetainedOptimizer

    g = torch.Generator(device="cuda").manual_seed(0)
    data = [torch.randint(0, 32768, (batch, seq + 1), device="cuda", generator=g) for _ in range(micro_batches)]

    def run(leto: bool) -> tuple[float, float, float, int]:
        torch.manual_seed(0)
        model = _GPT().cuda()
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        stepper = RetainedOptimizer.create(opt, retained_config(), settings=ProcessSettings.from_env()) if leto else opt
        compute, update, whole = [], [], []
        for it in range(1 + timed_iterations):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for tokens in data:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                (loss / micro_batches).backward()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            stepper.step()
            stepper.zero_grad()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if it:
                compute.append(t1 - t0)
                update.append(t2 - t1)
                whole.append(t2 - t0)
        if leto:
            stepper.store.close()
            stepper.store.unlink()
        del model, opt, stepper
        torch.cuda.empty_cache()
        return statistics.median(compute), statistics.median(update), statistics.median(whole), n

    c0, u0, w0, n = run(False)
    c1, u1, w1, _ = run(True)
    tokens = micro_batches * batch * seq
    return [
        (f"iteration: GPT {n / 1e9:.2f}B, bf16 autocast, {tokens} tokens/step, torch AdamW", w0, "s per iteration"),
        ("iteration: the same with Leto", w1, "s per iteration"),
        ("iteration: overhead of Leto (whole iteration)", (w1 / w0 - 1) * 100, "% (target <= +1 %)"),
        ("iteration: update phase, torch / Leto", f"{u0 * 1e3:.1f} / {u1 * 1e3:.1f}", "ms"),
        ("iteration: update overhead as a share of the iteration", (u1 - u0) / w0 * 100, "% (compute time "
         f"{c0:.2f} / {c1:.2f} s: not Leto's)"),
    ]


# -- the torch parity engine on the device ---------------------------------------------------------
def measure_engine(page: int = 4 * MiB, d: int = 8, repeats: int = 10) -> list[Row]:
    from leto_lightning.protection.codec import ReedSolomonCode
    from leto_lightning.protection.device import page_hashes, xor_groups

    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = torch.randint(0, 256, (64, page), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.empty_like(pages)
    copy = timed(lambda: dst.copy_(pages), repeats)
    rows: list[Row] = [("engine: device copy of 64 x 4 MiB", pages.numel() / copy / GB, "GB/s (read)")]
    hashes = timed(lambda: page_hashes(pages), repeats)
    index = torch.arange(64, device="cuda").view(8, 8)
    out = torch.empty(8, page, dtype=torch.uint8, device="cuda")
    xor = timed(lambda: xor_groups(pages, index, out), repeats)
    rows += [("engine: page hashes (mul64-i32) on the device", pages.numel() / hashes / GB, "GB/s of pages"),
             ("engine: XOR parity of 8 groups of 8 pages", pages.numel() / xor / GB, "GB/s of pages")]
    for h in (2,):
        code = ReedSolomonCode(d, h, "torch")
        data = list(pages[:d])
        parity = [torch.empty(page, dtype=torch.uint8, device="cuda") for _ in range(h)]
        enc = timed(lambda: code.encode(data, parity), repeats)
        rows.append((f"engine: torch Reed-Solomon encode H={h}", d * page / enc / GB, "GB/s of data"))
    return rows
