"""GPU check of the CUDA backend: run its tests, then measure it -- one call, under ~8 minutes.

    python benchmarks/gpu_check.py [--json results.json] [--skip-tests] [--params 100e6]

On a machine without a usable CUDA device it prints ``no CUDA device: skipped`` and exits 0.
With one it runs

1. the CUDA tests (``pytest -m cuda tests/cuda tests/protection/test_staging.py``);
2. CUDA IPC: the state manager's allocation of a 1 GiB buffer, and a trainer-side attach of it
   (socket round trip + ``cudaIpcOpenMemHandle``), first and again;
3. update overhead: ``RetainedOptimizer.step()`` (chunk transactions, backend="cuda", 4 MiB
   pages, D=8, H1=1) vs plain ``torch.optim.AdamW.step()`` (foreach=False, the math the chunks
   run, and torch's default foreach) on a ~100M-parameter MLP, optimizer step only;
4. the torch parity engine on the device (D=8, H=1/2, 4 MiB pages): encode, delta, reconstruct,
   and the backend's staged delta (device pages, host parity), beside a device memcpy;

and prints one table (and writes it as JSON with ``--json``). Exit status: 1 when the tests
failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
GB = 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--skip-tests", action="store_true", help="measure only")
    parser.add_argument("--params", type=float, default=100e6, help="model size for the update overhead")
    parser.add_argument("--test-timeout", type=int, default=330, help="seconds for the test run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        why = "torch has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA device"
        print(f"no CUDA device: skipped ({why}; torch {torch.__version__})")
        return 0
    from leto_lightning.retained.backends.cuda_ipc import MANAGER_ENV, CudaStateManager, default_address

    rows: list[tuple[str, float | str, str]] = []
    tests_ok = True
    if not args.skip_tests:
        tests_ok, summary, seconds = run_tests(args.test_timeout)
        rows.append(("tests: pytest -m cuda", summary, f"{seconds:.0f} s"))
    manager = CudaStateManager.start(default_address(f"gpucheck-{os.getpid()}"), 0)
    os.environ[MANAGER_ENV] = manager.address
    try:
        torch.cuda.set_device(0)
        rows += measure_attach(manager)
        rows += measure_update(int(args.params))
        rows += measure_engine()
        stats = manager.stats()
        rows.append(("manager: device bytes allocated after frees", stats["allocated"], "B (expect 0)"))
    finally:
        manager.shutdown()
    header = (f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
              f"tests {'passed' if tests_ok else 'FAILED'}")
    print_table(header, rows)
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0 if tests_ok else 1


def run_tests(timeout: int) -> tuple[bool, str, float]:
    """The CUDA tests in a child pytest; (passed, pytest's summary line, seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/cuda", "tests/protection/test_staging.py"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out[-8000:], file=sys.stderr)
        return False, f"timed out after {timeout} s", time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-8000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode == 0, lines[-1] if lines else f"exit {proc.returncode}", time.perf_counter() - t0


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


def measure_attach(manager) -> list[tuple[str, float | str, str]]:
    from leto_lightning.retained.backends.cuda_ipc import CudaSegment

    t0 = time.perf_counter()
    torch.empty(1, device="cuda")  # this process's CUDA context (a shadow has it before it attaches)
    context = time.perf_counter() - t0
    name = f"leto-gpucheck{os.getpid()}-attach"
    t0 = time.perf_counter()
    manager.alloc(name, 1 << 30)
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


def _mlp(n_params: int) -> torch.nn.Module:
    width = 2048
    layers = max(1, round(n_params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()


def measure_update(n_params: int, repeats: int = 3) -> list[tuple[str, float | str, str]]:
    from leto_lightning.retained.config import RetainedConfig
    from leto_lightning.updater.retained_optimizer import RetainedOptimizer

    x = torch.randn(32, 2048, device="cuda")

    def step_time(make: Callable[[torch.nn.Module], object]) -> tuple[float, int]:
        model = _mlp(n_params)
        opt = make(model)
        model(x).square().mean().backward()  # gradients once; the step is what is timed
        seconds = timed(opt.step, repeats)
        n = sum(p.numel() for p in model.parameters())
        if isinstance(opt, RetainedOptimizer):
            opt.store.close()
            opt.store.unlink()
        del model, opt
        torch.cuda.empty_cache()
        return seconds, n

    plain, n = step_time(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False))
    foreach, _ = step_time(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    cfg = RetainedConfig(page_bytes=4 * MiB, data_pages=8, tier1_parity=1, backend="cuda")
    retained, _ = step_time(lambda m: RetainedOptimizer.create(torch.optim.AdamW(m.parameters(), lr=1e-4,
                                                                                 foreach=False), cfg))
    return [(f"update: AdamW foreach=False step, {n / 1e6:.0f}M params", plain * 1e3, "ms"),
            ("update: AdamW default (foreach) step", foreach * 1e3, "ms"),
            ("update: RetainedOptimizer step (chunk txns, H1=1)", retained * 1e3, "ms"),
            ("update: overhead vs foreach=False", retained / plain, "x")]


def measure_engine(page: int = 4 * MiB, d: int = 8, repeats: int = 10) -> list[tuple[str, float | str, str]]:
    from leto_lightning.protection.codec import ReedSolomonCode

    gen = torch.Generator(device="cuda").manual_seed(0)
    data = [torch.randint(0, 256, (page,), dtype=torch.uint8, device="cuda", generator=gen) for _ in range(d)]
    new = torch.randint(0, 256, (page,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = [torch.empty_like(p) for p in data]
    copy = timed(lambda: [o.copy_(s) for s, o in zip(data, dst)], repeats)
    rows = [(f"engine: device memcpy of D={d} x 4 MiB", d * page / copy / GB, "GB/s")]
    for h in (1, 2):
        code = ReedSolomonCode(d, h, "torch")
        parity = [torch.empty(page, dtype=torch.uint8, device="cuda") for _ in range(h)]
        enc = timed(lambda: code.encode(data, parity), repeats)
        delta = timed(lambda: code.apply_delta(3, data[3], new, parity), repeats)
        lost = list(range(h))
        rec = timed(lambda: code.reconstruct(data, parity, lost), repeats)
        host_code = ReedSolomonCode(d, h, "auto")  # host parity: ISA-L when available
        host_parity = [torch.zeros(page, dtype=torch.uint8) for _ in range(h)]
        staged = timed(lambda: host_code.apply_delta(3, data[3], new, host_parity), repeats)
        rows += [(f"engine: torch encode H={h}", d * page / enc / GB, "GB/s of data"),
                 (f"engine: torch delta H={h}", page / delta / GB, "GB/s of the page"),
                 (f"engine: torch reconstruct H={h} lost", d * page / rec / GB, "GB/s of the group"),
                 (f"engine: staged delta to host parity H={h}", page / staged / GB,
                  f"GB/s of the page (host engine {host_code.engine.name})")]
    return rows


def print_table(header: str, rows: list[tuple[str, float | str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(header)
    print("-" * (width + 40))
    for name, value, unit in rows:
        shown = f"{value:12.3f}" if isinstance(value, float) else f"{value!s:>12}"
        print(f"{name:<{width}}  {shown}  {unit}")


if __name__ == "__main__":
    sys.exit(main())
