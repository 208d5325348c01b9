"""``leto demo --core``: the retained-state core on a small real model, with real failures.

Two simulated devices train a small language model with AdamW on retained memory. The demo
SIGKILLs a trainer half-way through an update, poisons pages, wipes a whole device, and
recovers each time in a fresh process -- then checks the result against a fault-free run
with ``torch.equal``.
"""

from __future__ import annotations

import random
import time
from typing import cast

import torch

from ..env import ProcessSettings


def run_core(optimizer: str = "adamw", seed: int = 0) -> int:
    """The core demo (``optimizer``: a name of ``testing.scenario.OPTIMIZERS``); 0 when every
    recovery was bit-identical and the damage beyond parity was refused."""
    from rich.console import Console

    torch.set_num_threads(1)  # bit-identical across processes needs one thread count
    console = Console()
    demo = CoreDemo(optimizer, seed)
    try:
        lay, cfg = demo.layout, demo.sc.config
        console.print(f"[bold]model[/]: {sum(p.numel for p in lay.params):,} params, optimizer {optimizer}, "
                      f"2 devices; retained: {lay.describe()}; parity D={cfg.data_pages} "
                      f"H1={cfg.tier1_parity} H2={cfg.tier2_parity}")
        demo.train(2)
        demo.kill_mid_update(2)
        demo.poison_pages(3)
        demo.lose_device(4)
        ok = demo.beyond_parity()
        console.print(demo.table)
        console.print("Every recovery ran in a fresh process; 'bit-identical' compares weights and optimizer "
                      "state with a fault-free torch.optim run using torch.equal.")
        return 0 if ok else 1
    finally:
        demo.job.close()


class CoreDemo:
    """The failures of ``leto demo --core``, one method each, each recovered in a fresh process
    and compared with the fault-free ``torch.optim`` run; one table row per failure."""

    def __init__(self, optimizer: str, seed: int) -> None:
        from rich.table import Table

        from ..testing.scenario import CoreScenario

        self.sc = CoreScenario(optimizer=optimizer, seed=seed)
        self.rng = random.Random(seed)
        self.ref = self.sc.reference(6)
        self.job = self.sc.create_job()
        self.layout = self.job.stores[0].layout
        self.table = Table(title="leto demo: failures and recoveries")
        for col in ("iteration", "failure", "recovery", "time", "bit-identical"):
            self.table.add_column(col)

    def stores(self) -> dict:
        from ..retained.store import RetainedStore

        return {r: RetainedStore.attach(self.job.job_id, r) for r in range(self.sc.n_ranks)}

    def train(self, iterations: int) -> None:
        for it in range(iterations):
            for r in range(self.sc.n_ranks):
                self.job.step(r, it)

    def _recover_and_check(self, until: int) -> tuple[str, float, bool]:
        from ..testing.scenario import differences, run_step, snapshot
        from ..updater.recovery import recover_node

        t0 = time.perf_counter()
        reports = recover_node(self.stores(), settings=ProcessSettings.from_env())
        seconds = time.perf_counter() - t0
        same = []
        for r in range(self.sc.n_ranks):
            model, ro = self.job.attach_trainer(r)
            for it in range(ro.iteration, until + 1):
                run_step(self.sc, model, ro, r, it)
            same.append(not differences(snapshot(model, ro.optimizer), self.ref[r][until + 1]))
        return _describe(reports), seconds, all(same)

    def _row(self, iteration: int, failure: str) -> None:
        from ..testing.crash import run_in_child

        result = run_in_child(lambda: self._recover_and_check(iteration)).value
        summaries, seconds, same = cast(tuple[str, float, bool], result)
        self.table.add_row(str(iteration), failure, summaries, f"{seconds * 1e3:.1f} ms", _yes(same))

    def _shadow_step(self, rank: int, it: int) -> None:
        from ..testing.scenario import run_step

        model, ro = self.job.attach_trainer(rank)
        run_step(self.sc, model, ro, rank, it)

    def kill_mid_update(self, it: int) -> None:
        """SIGKILL half-way through the update of ``it`` on device 0 (parity half-updated)."""
        from ..testing.crash import KillPoint, run_in_child

        chunk = self.rng.randrange(1, self.layout.n_chunks)
        assert run_in_child(lambda: self._shadow_step(0, it), kill_at=KillPoint("chunk.tier1_partial", chunk)).killed
        run_in_child(lambda: self._shadow_step(1, it))
        self._row(it, f"SIGKILL device 0 mid-update (chunk {chunk}, parity half-updated)")

    def poison_pages(self, it: int) -> None:
        """Overwrite H1 pages of one tier-1 group on each device (ECC-style corruption)."""
        lay, poisoned = self.layout, []
        for r, store in enumerate(self.job.stores):
            group = self.rng.choice([g for g, pages in enumerate(store.spec.tier1.groups)
                                     if lay.page_kind[pages[0]] != "grad" and len(pages) > 1])
            for p in self.rng.sample(store.spec.tier1.groups[group], self.sc.config.tier1_parity):
                store.pages[p].view(torch.int64)[self.rng.randrange(lay.page_bytes // 8)] ^= 0x5A5A
                poisoned.append((r, p))
        self._row(it, f"{len(poisoned)} pages poisoned (ECC-style) on 2 devices")

    def lose_device(self, it: int) -> None:
        """A whole device's retained state lost: tier 2 rebuilds it from the other device."""
        self.job.stores[1].pages.fill_(0)
        self._row(it, "device 1 lost all its retained pages")

    def beyond_parity(self) -> bool:
        """More damage than parity covers: detected and reported, never used."""
        from ..updater.recovery import recover_node
        from ..updater.repair import UnrecoverableDamageError

        n = self.sc.config.tier1_parity + 1
        for p in self.job.stores[0].spec.tier1.groups[0][:n]:
            for store in self.job.stores:
                store.pages[p].fill_(0xFF)
        try:
            recover_node(self.stores(), settings=ProcessSettings.from_env())
            outcome, ok = "NOT DETECTED", False
        except UnrecoverableDamageError as exc:
            outcome, ok = f"refused: {str(exc)[:160]}...", True
        self.table.add_row("5", f"{n} pages of one group lost on both devices", outcome, "-",
                           "n/a (falls back to checkpoint)" if ok else "[red]FAILED[/]")
        return ok


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
