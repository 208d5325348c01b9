"""Parity engine throughput: encode, delta update and reconstruct vs a plain memory copy.

For each parity count H and each available engine (ISA-L, torch), times on one group of
D data pages:

* encode       -- all H parity pages from the D data pages; MB/s of data (D pages)
* delta        -- one changed page folded into the H parities (``apply_delta`` with a
                  scratch buffer); MB/s of the one page
* reconstruct  -- H lost data pages rebuilt from the survivors; MB/s of the group (D pages)

beside ``memcpy`` (torch ``copy_`` of the same D pages into preallocated buffers in the
same run: the physical limit) and beside ``reedsolo`` (pure Python, timed on a small
slice and scaled: it is ~10^4 times slower). Every result is verified. Medians of
``--repeats`` runs.

    python benchmarks/parity_engine.py --page-mib 4 --data-pages 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import reedsolo
import torch

from leto_lightning.protection import ReedSolomonCode, available_engines, get_engine

MB = 1e6


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm up: tables, caches, page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_mbs(data: list[torch.Tensor], repeats: int) -> float:
    dst = [torch.empty_like(d) for d in data]

    def run() -> None:
        for s, d in zip(data, dst):
            d.copy_(s)

    return sum(d.numel() for d in data) / median_seconds(run, repeats) / MB


def engine_rows(code: ReedSolomonCode, data: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """MB/s for encode, delta and reconstruct with one engine; asserts every result."""
    page, h = data[0].numel(), code.m
    parity = [torch.empty(page, dtype=torch.uint8) for _ in range(h)]
    group_bytes = page * len(data)
    out = {"encode": group_bytes / median_seconds(lambda: code.encode(data, parity), repeats) / MB}
    reference = [p.clone() for p in parity]

    new = torch.randint(0, 256, (page,), dtype=torch.uint8)
    old, scratch = data[0].clone(), torch.empty(page, dtype=torch.uint8)
    t = median_seconds(lambda: code.apply_delta(0, old, new, parity, scratch), repeats)
    out["delta"] = page / t / MB
    # delta applied 1 + repeats times (an even or odd count): parity holds either state
    data[0].copy_(new if (1 + repeats) % 2 else old)
    assert code.verify(data, parity) == [], "delta-updated parity differs from a fresh encode"
    data[0].copy_(old)
    code.encode(data, parity)
    assert all(torch.equal(a, b) for a, b in zip(parity, reference))

    lost = list(range(1, 1 + h))
    originals = [data[i].clone() for i in lost]
    out["reconstruct"] = group_bytes / median_seconds(lambda: code.reconstruct(data, parity, lost), repeats) / MB
    for i in lost:
        data[i].fill_(0)
    code.reconstruct(data, parity, lost)
    assert all(torch.equal(data[i], o) for i, o in zip(lost, originals)), "reconstruction differs"
    return out


def delta_strategies(engine_name: str, page: int, hs: list[int], pages: int = 12) -> None:
    """apply_delta's two options on cache-cold pages: XOR into scratch + one update vs two updates."""
    from leto_lightning.protection import gf256

    engine = get_engine(engine_name)
    olds = [torch.randint(0, 256, (page,), dtype=torch.uint8) for _ in range(pages)]
    news = [torch.randint(0, 256, (page,), dtype=torch.uint8) for _ in range(pages)]
    scratch = torch.empty(page, dtype=torch.uint8)
    print(f"\napply_delta strategies ({engine_name}, {pages} distinct pages, MB/s of the changed page):")
    for h in hs:
        col = gf256.cauchy_matrix(8, h)[:, 3]
        parity = [torch.randint(0, 256, (page,), dtype=torch.uint8) for _ in range(h)]
        t_scratch, t_two = [], []
        for _ in range(3):
            for old, new in zip(olds, news):
                t0 = time.perf_counter()
                torch.bitwise_xor(old, new, out=scratch)
                engine.mad(col, scratch, parity)
                t1 = time.perf_counter()
                engine.mad(col, old, parity)
                engine.mad(col, new, parity)
                t_scratch.append(t1 - t0)
                t_two.append(time.perf_counter() - t1)
        mbs = [page / statistics.median(t) / MB for t in (t_scratch, t_two)]
        print(f"  H={h}: delta into scratch + 1 update {mbs[0]:,.0f}   two updates {mbs[1]:,.0f}")


def reedsolo_rows(d: int, h: int, slice_bytes: int) -> dict[str, float]:
    """reedsolo on ``slice_bytes`` of group data (one codeword per byte column), scaled to MB/s."""
    rs = reedsolo.RSCodec(h)
    cols = max(1, slice_bytes // d)
    msgs = [bytearray(np.random.randint(0, 256, d, dtype=np.uint8).tobytes()) for _ in range(cols)]
    t0 = time.perf_counter()
    words = [rs.encode(m) for m in msgs]
    t_enc = time.perf_counter() - t0
    erase = list(range(1, 1 + h))
    damaged = [bytearray(w) for w in words]
    for w in damaged:
        for p in erase:
            w[p] = 0
    t0 = time.perf_counter()
    decoded = [rs.decode(w, erase_pos=erase)[0] for w in damaged]
    t_dec = time.perf_counter() - t0
    assert all(bytes(a) == bytes(b) for a, b in zip(decoded, msgs)), "reedsolo decode differs"
    group = cols * d
    # no delta API: one changed page means re-encoding its whole group
    return {"encode": group / t_enc / MB, "delta": (group / d) / t_enc / MB, "reconstruct": group / t_dec / MB}


def _cell(mbs: float, memcpy: float) -> str:
    ratio = mbs / memcpy
    r = f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.2f}" if ratio >= 0.01 else f"{ratio:.0e}"
    return f"{mbs:,.{1 if mbs < 100 else 0}f} ({r}x)".rjust(20)


def print_table(h: int, page_mib: float, d: int, memcpy: float, rows: dict[str, dict[str, float]]) -> None:
    print(f"\nD={d}, H={h}, {page_mib:g} MiB pages -- MB/s of data processed (x memcpy)")
    print(f"{'engine':<12}{'encode':>20}{'delta (1 page)':>20}{'reconstruct':>20}")
    print(f"{'memcpy':<12}" + _cell(memcpy, memcpy) * 3)
    for name, r in rows.items():
        cells = "".join(_cell(r[c], memcpy) for c in ("encode", "delta", "reconstruct"))
        print(f"{name:<12}{cells}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-mib", type=float, default=4.0, help="page size in MiB (default 4)")
    ap.add_argument("--data-pages", type=int, default=8, help="data pages per group, D (default 8)")
    ap.add_argument("--parity", default="1,2", help="comma-separated parity counts H (default 1,2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cell; the median is shown")
    ap.add_argument("--engines", default=",".join(available_engines()), help="engines to time (default: all available)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: ISA-L uses one core too)")
    ap.add_argument(
        "--delta-strategies", default="1,2,4", help="H values for the apply_delta strategy table ('' to skip)"
    )
    ap.add_argument("--reedsolo-kib", type=int, default=64, help="group data reedsolo is timed on (KiB, scaled)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    page = int(args.page_mib * (1 << 20))
    d = args.data_pages
    data = [torch.randint(0, 256, (page,), dtype=torch.uint8) for _ in range(d)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; engines: {args.engines}; "
          f"reedsolo timed on {args.reedsolo_kib} KiB and scaled")
    for h in (int(x) for x in args.parity.split(",")):
        memcpy = memcpy_mbs(data, args.repeats)
        rows = {
            name: engine_rows(ReedSolomonCode(d, h, get_engine(name)), data, args.repeats)
            for name in args.engines.split(",")
        }
        rows["reedsolo*"] = reedsolo_rows(d, h, args.reedsolo_kib << 10)
        print_table(h, args.page_mib, d, memcpy, rows)
    if args.delta_strategies:
        hs = [int(x) for x in args.delta_strategies.split(",")]
        for name in args.engines.split(","):
            delta_strategies(name, page, hs)
    print("\n* reedsolo: pure Python, measured on a slice and scaled; no delta API, so 'delta' re-encodes the group. "
          "All results verified (parity == fresh encode, reconstructed == original).")


if __name__ == "__main__":
    main()
