"""``leto demo``: end to end (demo_e2e.py) or, with ``--core``, the retained-state core alone.

The core demo: the retained-state core on a small real model, with real failures.

Two simulated devices train a small language model with AdamW on retained memory. The demo
SIGKILLs a trainer half-way through an update, poisons pages, wipes a whole device, and
recovers each time in a fresh process -- then checks the result against a fault-free run
with ``torch.equal``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="tiny OLMoE on 2 CPU ranks with HOFs injected, recovered in place, checked bit-identical",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--core", action="store_true",
                   help="the retained-state core only (seconds): SIGKILL mid-update, poisoned pages, a lost device")
    p.add_argument("--steps", type=int, default=40, help="end-to-end: training iterations")
    p.add_argument("--hof-every", type=int, default=10, help="end-to-end: a HOF every N iterations")
    p.add_argument("--run-dir", default=None, help="end-to-end: outputs (default: leto-runs/demo-<time>)")
    p.add_argument("--optimizer", default="adamw", help="--core: adamw | adam_amsgrad | sgd_nesterov | ...")
    p.add_argument("--seed", type=int, default=0, help="--core: seed of the model, data and fault choices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.core:
        return run_core(args)
    import os
    import time as _time

    from .demo_e2e import run_demo

    run_dir = args.run_dir or os.path.join("leto-runs", f"demo-{_time.strftime('%Y%m%d-%H%M%S')}")
    return run_demo(args.steps, args.hof_every, run_dir)


def run_core(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .faults.crash import KillPoint, run_in_child
    from .faults.scenario import CoreScenario, differences, run_step, snapshot
    from .protection.repair import UnrecoverableDamageError
    from .retained.store import RetainedStore
    from .updater.recovery import recover_node

    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    console = Console()
    sc = CoreScenario(optimizer=args.optimizer, seed=args.seed)
    rng = random.Random(args.seed)
    steps = 6
    ref = sc.reference(steps)
    job = sc.create_job()
    table = Table(title="leto demo: failures and recoveries")
    for col in ("iteration", "failure", "recovery", "time", "bit-identical"):
        table.add_column(col)
    try:
        lay = job.stores[0].layout
        console.print(f"[bold]model[/]: {sum(p.numel for p in lay.params):,} params, optimizer {args.optimizer}, "
                      f"2 devices; retained: {lay.describe()}; parity D={sc.config.data_pages} "
                      f"H1={sc.config.tier1_parity} H2={sc.config.tier2_parity}")

        def stores():
            return {r: RetainedStore.attach(job.job_id, r) for r in range(sc.n_ranks)}

        def recover_and_check(until: int):
            t0 = time.perf_counter()
            reports = recover_node(stores())
            seconds = time.perf_counter() - t0
            same = []
            for r in range(sc.n_ranks):
                model, ro = job.attach_trainer(r)
                for it in range(ro.iteration, until + 1):
                    run_step(sc, model, ro, r, it)
                same.append(not differences(snapshot(model, ro.optimizer), ref[r][until + 1]))
            return _describe(reports), seconds, all(same)

        def shadow_step(rank: int, it: int):
            model, ro = job.attach_trainer(rank)
            run_step(sc, model, ro, rank, it)

        for it in range(2):
            for r in range(sc.n_ranks):
                job.step(r, it)
        # 1. SIGKILL half-way through the update of iteration 2 on device 0.
        chunk = rng.randrange(1, lay.n_chunks)
        kill = KillPoint("chunk.tier1_partial", chunk)
        assert run_in_child(lambda: shadow_step(0, 2), kill_at=kill).killed
        run_in_child(lambda: shadow_step(1, 2))
        summaries, seconds, same = run_in_child(lambda: recover_and_check(2)).value
        table.add_row("2", f"SIGKILL device 0 mid-update (chunk {chunk}, parity half-updated)",
                      summaries, f"{seconds * 1e3:.1f} ms", _yes(same))
        # 2. Poison H1 pages in a tier-1 group on each device.
        poisoned = []
        for r, store in enumerate(job.stores):
            group = rng.choice([g for g, pages in enumerate(store.spec.tier1.groups)
                                if lay.page_kind[pages[0]] != "grad" and len(pages) > 1])
            for p in rng.sample(store.spec.tier1.groups[group], sc.config.tier1_parity):
                store.pages[p].view(torch.int64)[rng.randrange(lay.page_bytes // 8)] ^= 0x5A5A
                poisoned.append((r, p))
        summaries, seconds, same = run_in_child(lambda: recover_and_check(3)).value
        table.add_row("3", f"{len(poisoned)} pages poisoned (ECC-style) on 2 devices", summaries,
                      f"{seconds * 1e3:.1f} ms", _yes(same))
        # 3. A whole device's retained state lost: tier 2 rebuilds it from the other device.
        job.stores[1].pages.fill_(0)
        summaries, seconds, same = run_in_child(lambda: recover_and_check(4)).value
        table.add_row("4", "device 1 lost all its retained pages", summaries,
                      f"{seconds * 1e3:.1f} ms", _yes(same))
        # 4. More damage than parity covers: detected and reported, never used.
        group = job.stores[0].spec.tier1.groups[0]
        for p in group[: sc.config.tier1_parity + 1]:
            for store in job.stores:
                store.pages[p].fill_(0xFF)
        try:
            recover_node(stores())
            outcome, ok = "NOT DETECTED", False
        except UnrecoverableDamageError as exc:
            outcome, ok = f"refused: {str(exc)[:160]}...", True
        table.add_row("5", f"{sc.config.tier1_parity + 1} pages of one group lost on both devices",
                      outcome, "-", "n/a (falls back to checkpoint)" if ok else "[red]FAILED[/]")
        console.print(table)
        console.print("Every recovery ran in a fresh process; 'bit-identical' compares weights and optimizer "
                      "state with a fault-free torch.optim run using torch.equal.")
        return 0 if ok else 1
    finally:
        job.close()


def _describe(reports) -> str:
    """One short line for a node's recovery (the repair report is shared by its ranks)."""
    any_report = next(iter(reports.values()))
    rep = any_report.repair
    parts = []
    restored = sum(len(r.restored) for r in reports.values())
    if restored:
        parts.append(f"undo-restored {restored} torn chunk(s)")
    rolled = sum(len(r.rolled_forward) for r in reports.values())
    if rolled:
        parts.append(f"rolled forward {rolled} chunk(s)")
    for tier, found in (("tier 1", rep.tier1), ("tier 2", rep.tier2)):
        n = sum(len(v) for v in found.values())
        if n:
            parts.append(f"{tier} rebuilt {n} page(s)")
    parts.append(f"resume at iteration {any_report.resume_iteration}")
    return "; ".join(parts)


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]NO[/]"
