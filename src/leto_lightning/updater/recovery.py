"""Recovery of retained state as a crash left it (DESIGN.md sections 2.2-2.3).

For the ranks of one node (a single rank is a node of one):

1. **Restore** every chunk caught in flight from the undo buffer (old contents, checksums,
   step counters and version), after checking the undo copy against its checksums.
2. **Repair** damaged pages (checksum mismatches) from tier-1 and tier-2 parity.
3. **Re-encode** the parity the interrupted transactions may have half-updated.
4. **Agree** on the resume point: if every rank prepared iteration ``t``, roll forward; if
   some never prepared it, abort ``t`` everywhere (nothing of it can have committed: the
   prepare barrier comes first).
5. **Roll forward** the chunks still at version ``t`` with the retained gradients and the
   hyper-parameters recorded at prepare -- the same deterministic math, so the result is
   bit-identical to an update that never failed -- and commit ``t``.

A **rollback window** (``RetainedOptimizer(rollback_window=True)``, manual optimization) keeps
an iteration *open* from its prepare until the trainer seals it at the batch end. If any rank
of the job is still open at ``t``, every rank rolls ``t`` back instead (``roll_back``): the
whole-state undo copy of ``t`` is intact on every rank, because no rank can start ``t + 1``'s
update before every rank prepared ``t + 1``; each resumes from the payload it sealed before
``t`` and the trainers redo iteration ``t`` from its start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ..errors import ConfigurationError
from ..protection.repair import RepairReport, page_ok, repair
from ..retained.record import read_all
from ..retained.store import (
    IDLE,
    PHASE_NAMES,
    UNDO_CHUNK,
    UNDO_CRCS,
    UNDO_NPAGES,
    UNDO_NPIECES,
    UNDO_VERSION,
    UNDO_WHOLE,
    RetainedStore,
)
from .whole_state import restore_whole
from ..errors import RecoveryError
from .transaction import COMMITTED, PREPARED, ChunkTransactions, ParityCodes


@dataclass
class RecoveryReport:
    rank: int
    status_found: str | None = None  # progress record status as found
    iteration_found: int | None = None
    restored: list[tuple[int, str]] = field(default_factory=list)  # (chunk, phase it was in)
    rolled_forward: list[int] = field(default_factory=list)
    aborted: bool = False
    rolled_back: bool = False  # an open iteration (rollback window) undone
    committed_iteration: int = -1  # the job resumes at committed_iteration + 1
    pending_step: bool = False  # generic optimizer: the trainer finishes the prepared step on bind
    payload: object = None
    repair: RepairReport | None = None
    reencoded_tier1: list[int] = field(default_factory=list)
    reencoded_tier2: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def resume_iteration(self) -> int:
        return self.committed_iteration + 1

    def summary(self) -> str:
        rep = self.repair
        return (
            f"rank {self.rank}: found {self.status_found}({self.iteration_found}); restored {len(self.restored)} "
            f"in-flight chunk(s); repaired {rep.repaired if rep else 0} page(s); rolled forward "
            f"{len(self.rolled_forward)} chunk(s);{' rolled back an open iteration;' if self.rolled_back else ''} "
            f"resume at iteration {self.resume_iteration}"
        )


def restore_in_flight(store: RetainedStore) -> tuple[list[tuple[int, str]], list[int]]:
    """Put every in-flight chunk back to its pre-transaction contents; returns them and their pages."""
    restored, touched = [], []
    if store.in_flight() and int(store.undo_header[UNDO_CHUNK]) == UNDO_WHOLE:
        return [(-1, "whole-state")], restore_whole_checked(store, "the whole-state transaction")
    for chunk in store.in_flight():
        phase = PHASE_NAMES[int(store.chunk_table[chunk, 1])]
        head = store.undo_header
        if int(head[UNDO_CHUNK]) != chunk:
            raise RecoveryError(f"rank {store.spec.rank}: chunk {chunk} is in flight but the undo buffer holds chunk "
                                f"{int(head[UNDO_CHUNK])}")
        pages = store.layout.chunk_pages_updated(chunk)
        n_pages, n_pieces = int(head[UNDO_NPAGES]), int(head[UNDO_NPIECES])
        if n_pages != len(pages):
            raise RecoveryError(f"undo header of chunk {chunk} names {n_pages} pages, layout has {len(pages)}")
        undo = store.undo_view(n_pages)
        crcs = head[UNDO_CRCS : UNDO_CRCS + n_pages]
        for i, p in enumerate(pages):
            store.pages[p].copy_(undo[i])
        store.crcs[pages] = crcs.clone()
        bad = [p for p in pages if not page_ok(store, p)]
        if bad:
            raise RecoveryError(
                f"rank {store.spec.rank}: the undo copy of in-flight chunk {chunk} is damaged (pages {bad}); "
                "its old contents are lost -- resume from the last checkpoint"
            )
        first = store.layout.chunk_first_piece[chunk]
        old_steps = head[UNDO_CRCS + n_pages : UNDO_CRCS + n_pages + n_pieces].view(torch.float64)
        store.steps[first : first + n_pieces] = old_steps.float()
        store.chunk_table[chunk, 0] = int(head[UNDO_VERSION])
        store.chunk_table[chunk, 1] = IDLE
        restored.append((chunk, phase))
        touched.extend(pages)
    return restored, touched


def restore_whole_checked(store: RetainedStore, what: str) -> list[int]:
    """``restore_whole``, then every restored page checked against its restored checksum: a
    damaged undo copy is refused, never resumed from. Returns the pages."""
    pages = restore_whole(store)
    bad = [p for p in pages if not page_ok(store, p)]
    if bad:
        raise RecoveryError(f"rank {store.spec.rank}: the undo copy of {what} is damaged (pages {bad[:10]}); "
                            "resume from the last checkpoint")
    return pages


def reencode(stores: Mapping[int, RetainedStore], codes: ParityCodes, touched: Mapping[int, list[int]]) -> tuple[list, list]:
    """Recompute the parity that covers ``touched`` pages (local rank -> pages)."""
    groups1, stripes = [], set()
    for r, pages in touched.items():
        store = stores[r]
        plan = store.spec.tier1
        if codes.tier1 is not None:
            for g in plan.groups_of(pages):
                codes.tier1.encode([store.pages[p] for p in plan.groups[g]], list(store.parity1[g]))
                groups1.append((r, g))
        stripes.update(int(store.spec.tier2.page_stripe[p]) for p in pages)
    stripes.discard(-1)
    if codes.tier2 is not None and stripes and len(stores) == codes.tier2.k:
        any_store = next(iter(stores.values()))
        page_of = {int(s): p for p, s in enumerate(any_store.spec.tier2.page_stripe) if s >= 0}
        for s in sorted(stripes):
            codes.tier2.encode([stores[r].pages[page_of[s]] for r in sorted(stores)], list(any_store.parity2[s]))
    return groups1, sorted(stripes)


def latest(store: RetainedStore) -> dict | None:
    entries = read_all(store.record)
    return entries[-1].payload if entries else None


def local_agreement(summary: dict[int, tuple | list | None]) -> tuple[int | None, bool, int | None]:
    """From ``{rank: (status, iteration, open)}``: (target iteration, did every rank reach it,
    the open iteration to roll back everywhere or None)."""
    iterations = [s[1] for s in summary.values() if s is not None]
    target = max(iterations, default=None)
    opened = [s[1] for s in summary.values() if s is not None and len(s) > 2 and s[2]]
    return target, all(s is not None and s[1] == target for s in summary.values()), min(opened, default=None)


def _summary(rec: dict | None) -> tuple | None:
    return (rec["status"], rec["iteration"], bool(rec.get("open"))) if rec else None


def recover_node(stores: Mapping[int, RetainedStore], codes: ParityCodes | None = None,
                 agree: Callable[[dict], tuple[int | None, bool, int | None]] = local_agreement,
                 ) -> dict[int, RecoveryReport]:
    """Recover the ranks of one node (keyed by local rank); see the module docstring.

    ``agree`` turns this node's ``{rank: (status, iteration, open)}`` into the job-wide
    decision (``local_agreement``: target iteration, whether every rank of the job prepared or
    committed it, an open iteration to roll back); a multi-node agent exchanges the summaries
    through the job's store before anything rolls forward or back.
    """
    if not stores:
        raise ConfigurationError("recover_node needs at least one store")
    codes = codes or ParityCodes(next(iter(stores.values())))
    reports = {r: RecoveryReport(rank=s.spec.rank) for r, s in stores.items()}
    touched: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for r, store in stores.items():
        reports[r].restored, touched[r] = restore_in_flight(store)
    t1 = time.perf_counter()
    records = {r: latest(s) for r, s in stores.items()}
    for r, rec in records.items():
        reports[r].status_found = rec and rec["status"]
        reports[r].iteration_found = rec and rec["iteration"]
    # Gradients matter only where a prepared step will be rolled forward with them.
    include_grads = {r for r, rec in records.items() if rec and rec["status"] == PREPARED and not rec.get("open")}
    rep = repair(stores, codes.tier1, codes.tier2, include_grads)
    t2 = time.perf_counter()
    groups1, stripes = reencode(stores, codes, touched)
    t3 = time.perf_counter()
    summary = {stores[r].spec.rank: _summary(records[r]) for r in stores}
    target, everyone, rollback = agree(summary)
    if rollback is None:
        decide_and_roll_forward(stores, records, reports, codes, target, everyone)
    else:
        undone = {r: roll_back(store, rollback, reports[r]) for r, store in stores.items()}
        more1, more2 = reencode(stores, codes, undone)
        groups1, stripes = groups1 + more1, sorted(set(stripes) | set(more2))
    t4 = time.perf_counter()
    for r, report in reports.items():
        report.repair = rep
        report.reencoded_tier1 = [g for (q, g) in groups1 if q == r]
        report.reencoded_tier2 = stripes
        report.seconds = {"restore": t1 - t0, "verify_repair": t2 - t1, "reencode": t3 - t2, "roll_forward": t4 - t3}
    return reports


def decide_and_roll_forward(stores, records, reports, codes: ParityCodes, target: int | None,
                            everyone_reached: bool) -> None:
    for r, store in stores.items():
        rec, report = records[r], reports[r]
        if rec is None:
            _check_versions(store, 0)
            continue
        if (rec["status"] == PREPARED and everyone_reached and store.layout.family == "generic"
                and not bool((store.versions() == rec["iteration"] + 1).all())):
            report.pending_step = True  # needs the optimizer object: RetainedOptimizer.bind(adopt=True)
            _check_versions(store, rec["iteration"])
            report.committed_iteration = rec["iteration"]  # the step is re-run bit-identically on bind
            report.payload = rec["payload"]
            continue
        if rec["status"] == PREPARED and everyone_reached:
            report.rolled_forward = roll_forward(store, rec, codes)
        elif rec["status"] == PREPARED:
            report.aborted = True
            rec = abort_prepared(store, rec)
        _check_versions(store, rec["iteration"] + 1 if rec["status"] == COMMITTED else rec["iteration"])
        report.committed_iteration = rec["iteration"] if rec["status"] == COMMITTED else rec["iteration"] - 1
        report.payload = rec["payload"]


def roll_back(store: RetainedStore, t: int, report: RecoveryReport) -> list[int]:
    """Undo the open iteration ``t`` on this rank (module doc); returns the pages restored.

    The rank may be anywhere from "never prepared ``t``" to "sealed ``t`` and prepared
    ``t + 1``" (no further: ``t + 1``'s update waits for the open rank's prepare)."""
    entries = [e.payload for e in read_all(store.record)]
    if not entries or entries[-1]["iteration"] < t:  # never prepared t: already where the job resumes
        _check_versions(store, t)
        latest = entries[-1] if entries else {"iteration": t - 1, "payload": None}
        report.committed_iteration, report.payload = latest["iteration"], latest["payload"]
        return []
    before = _payload_before(store, entries, t)
    pages: list[int] = []
    if bool((store.versions() == t + 1).all()):
        head = store.undo_header
        if int(head[UNDO_CHUNK]) != UNDO_WHOLE or int(head[UNDO_VERSION]) != t:
            raise RecoveryError(f"rank {store.spec.rank}: iteration {t} must be rolled back but the undo buffer holds "
                                f"{'chunk ' + str(int(head[UNDO_CHUNK])) if int(head[UNDO_CHUNK]) != UNDO_WHOLE else 'the whole state'}"
                                f" of iteration {int(head[UNDO_VERSION])}; resume from the last checkpoint")
        pages = restore_whole_checked(store, f"open iteration {t}")
    _check_versions(store, t)
    store.record.write({"status": COMMITTED, "iteration": t - 1, "payload": before})
    report.rolled_back = True
    report.committed_iteration, report.payload = t - 1, before
    return pages


def _payload_before(store: RetainedStore, entries: list[dict], t: int) -> object:
    """The payload a rank sealed before iteration ``t``: in ``t``'s open records, or kept as
    ``before`` in the records that sealed ``t``."""
    for rec in reversed(entries):
        if rec["iteration"] == t and rec.get("open"):
            return rec["payload"]
        if rec["iteration"] == t and "before" in rec:
            return rec["before"]
    raise RecoveryError(f"rank {store.spec.rank}: iteration {t} must be rolled back but no record keeps the state "
                        "before it; resume from the last checkpoint")


def roll_forward(store: RetainedStore, rec: dict, codes: ParityCodes) -> list[int]:
    """Finish iteration ``rec['iteration']``: update the chunks still at its version, commit."""
    t = rec["iteration"]
    versions = store.versions()
    pending = [c for c in range(store.layout.n_chunks) if int(versions[c]) == t]
    txn = ChunkTransactions(store, codes)
    txn.update_chunks(t, rec["hparams"], rec["skip_params"], chunks=pending)
    txn.commit(t, rec["payload"])
    rec.update(status=COMMITTED)
    return pending


def abort_prepared(store: RetainedStore, rec: dict) -> dict:
    """Undo a prepare that not every rank reached: nothing of it may have committed."""
    t = rec["iteration"]
    if bool((store.versions() == t + 1).any()):
        raise RecoveryError(f"rank {store.spec.rank}: iteration {t} must be aborted (a peer never prepared it) but "
                            "chunks of it already committed: the prepare barrier was not respected")
    earlier = [e.payload for e in read_all(store.record) if e.payload["status"] == COMMITTED]
    previous = earlier[-1] if earlier else {"status": COMMITTED, "iteration": t - 1, "payload": None}
    store.record.write(previous)
    return previous


def _check_versions(store: RetainedStore, expected: int) -> None:
    versions = store.versions()
    wrong = (versions != expected).nonzero().flatten().tolist()
    if wrong:
        raise RecoveryError(
            f"rank {store.spec.rank}: chunks {wrong[:10]} are at versions "
            f"{sorted(set(int(versions[c]) for c in wrong))}, expected {expected} everywhere"
        )
