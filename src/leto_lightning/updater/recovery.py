"""Recovery of retained state as a crash left it (docs/design.md sections 2.2-2.3).

For the ranks of one node (a single rank is a node of one):

0. **Check** that every store is complete (its creator finished set-up) and that every piece of
   metadata validates in at least one of its two copies, repairing the other
   (``retained.integrity``); find the chunk in flight from the checksummed undo header.
1. **Restore** every chunk caught in flight from the undo buffer (old contents, checksums,
   step counters and version), after checking the undo copy against its checksums.
2. **Repair** damaged pages (checksum mismatches) from tier-1 and tier-2 parity.
3. **Agree** on the resume point: if every rank prepared iteration ``t``, roll forward; if
   some never prepared it, abort ``t`` everywhere (nothing of it can have committed: the
   prepare barrier comes first). A rank still prepared at an earlier iteration than ``t`` (a
   spare rebuilt from the cross-node tier's copy, ``updater/tier3.py``) rolls that one forward:
   every other rank committed it before preparing ``t``.
4. **Verify parity**: re-encode every group whose parity differs from its verified data (a
   damaged parity page, or parity an interrupted transaction -- or an interrupted earlier
   recovery -- half-updated).
5. **Roll forward** the chunks still at version ``t`` with the retained gradients and the
   hyper-parameters recorded at prepare -- the same deterministic math, so the result is
   bit-identical to an update that never failed -- and commit ``t``.

Every step is restartable: recovery itself may be killed anywhere and run again. Nothing it
relies on (the undo buffer, its header, the records) is changed before what it protects is
repaired, every write it makes is one a later run redoes or finds already done, and parity is
verified on every run, so an earlier run's half-written parity is found and rewritten.

A **rollback window** (``RetainedOptimizer(rollback_window=True)``, manual optimization) keeps
an iteration *open* from its prepare until the trainer seals it at the batch end. If any rank
of the job is still open at ``t``, every rank rolls ``t`` back instead (``roll_back``): the
whole-state undo copy of ``t`` is intact on every rank, because no rank can start ``t + 1``'s
update before every rank prepared ``t + 1``; each resumes from the payload it sealed before
``t`` and the trainers redo iteration ``t`` from its start.

Only ``LetoError``s leave ``recover_node``: anything else is reported as a ``RecoveryError``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..env import ProcessSettings
from ..errors import (
    CHECKPOINT_ADVICE,
    ConfigurationError,
    InternalError,
    LetoError,
    RecoveryError,
    UnrecoverableDamageError,
)
from ..faults.points import point
from ..retained.integrity import Metadata, MetaVerdict, check_metadata, header_fields
from ..retained.record import ProgressEntry, RecordStatus, read_all
from ..retained.store import UNDO_CRCS, UNDO_WHOLE, ChunkPhase, RetainedStore
from .repair import RepairReport, page_ok, repair, verify_parity
from .transaction import ChunkTransactions, ParityCodes
from .whole_state import restore_whole, tail_crc


@dataclass
class RecoveryReport:
    rank: int
    status_found: RecordStatus | None = None  # progress record status as found
    iteration_found: int | None = None
    restored: list[tuple[int, str]] = field(default_factory=list)  # (chunk, phase it was in)
    rolled_forward: list[int] = field(default_factory=list)
    aborted: bool = False
    rolled_back: bool = False  # an open iteration (rollback window) undone
    committed_iteration: int = -1  # the job resumes at committed_iteration + 1
    pending_step: bool = False  # generic optimizer: the trainer finishes the prepared step on bind
    payload: object = None
    repair: RepairReport | None = None
    metadata_repaired: list[str] = field(default_factory=list)  # metadata copies rewritten from the other
    reencoded_tier1: list[int] = field(default_factory=list)  # groups whose parity was found wrong and rewritten
    reencoded_tier2: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def resume_iteration(self) -> int:
        return self.committed_iteration + 1

    def summary(self) -> str:
        rep = self.repair
        return (
            f"rank {self.rank}: found {self.status_found}({self.iteration_found}); restored {len(self.restored)} "
            f"in-flight chunk(s); repaired {rep.repaired if rep else 0} page(s) "
            f"({sum(len(v) for v in rep.tier2.values()) if rep else 0} by tier 2), {len(self.metadata_repaired)} "
            f"metadata item(s), parity of {len(self.reencoded_tier1)} group(s); rolled forward "
            f"{len(self.rolled_forward)} chunk(s);{' rolled back an open iteration;' if self.rolled_back else ''} "
            f"resume at iteration {self.resume_iteration}"
        )


def check_store(store: RetainedStore) -> tuple[Metadata, MetaVerdict]:
    """Completion mark, spec copies, progress record and metadata of one store, every redundant
    copy verified and a damaged one rewritten from its twin; raises what cannot be repaired."""
    store.require_complete()
    rewritten = store.rewrite_damaged_copies()  # spec, completion mark, progress-record copies
    meta = Metadata(store)
    verdict = check_metadata(meta, UNDO_WHOLE)
    verdict.repaired[:0] = rewritten
    if verdict.lost:
        raise UnrecoverableDamageError({}, [f"rank {store.spec.rank}: {what}." for what in verdict.lost])
    return meta, verdict


def restore_in_flight(store: RetainedStore, meta: Metadata,
                      verdict: MetaVerdict) -> tuple[list[tuple[int, str]], list[int]]:
    """Put the chunk in flight back to its pre-transaction contents; returns it and its pages."""
    if not verdict.in_flight or verdict.header is None:  # in flight is only ever read from a header
        return [], []
    chunk, version, n_pages, n_pieces = header_fields(verdict.header)
    if chunk == UNDO_WHOLE:
        return [(-1, "whole-state")], restore_whole_checked(store, meta, verdict.header, "the whole-state transaction")
    phase = ChunkPhase.label(int(store.chunk_table[chunk, 1]))
    pages = store.layout.chunk_pages_updated(chunk)
    first, pieces = store.layout.chunk_first_piece[chunk], len(store.layout.chunk_pieces[chunk])
    if n_pages != len(pages) or n_pieces != pieces:
        raise RecoveryError(f"rank {store.spec.rank}: the undo header of chunk {chunk} names {n_pages} pages and "
                            f"{n_pieces} pieces, the layout has {len(pages)} and {pieces}. {CHECKPOINT_ADVICE}")
    head = torch.from_numpy(verdict.header)
    _copy_undo_back(store, chunk, pages)
    store.crcs[pages] = head[UNDO_CRCS : UNDO_CRCS + n_pages].clone()
    bad = [p for p in pages if not page_ok(store, p)]
    if bad:
        raise UnrecoverableDamageError({}, [
            f"rank {store.spec.rank}: segment {store.spec.name('undo')}: the undo copy of in-flight chunk {chunk} is "
            f"damaged (its copies of pages {bad} fail their checksums), so the chunk's old contents are lost."])
    steps_saved = head[UNDO_CRCS + n_pages : UNDO_CRCS + n_pages + n_pieces]
    store.steps[first : first + n_pieces] = steps_saved.view(torch.float64).float()
    store.chunk_table[chunk, 0] = version
    meta.seal_chunk(chunk)
    store.chunk_table[chunk, 1] = ChunkPhase.IDLE
    meta.mirror_chunk(chunk)
    return [(chunk, phase)], pages


def _copy_undo_back(store: RetainedStore, chunk: int, pages: list[int]) -> None:
    """The in-flight chunk's saved bytes back into its pages: all of them, or -- when the fused
    Adam kernel was saving the copy block by block -- the first ``undo_progress`` bytes of each
    kind (the kernel modifies nothing at or past that count). The restored pages are checked
    against their old checksums afterwards, so a damaged count cannot pass unnoticed."""
    undo = store.undo_view(len(pages))
    saved = int(store.undo_progress[0])
    if saved < 0:
        for i, p in enumerate(pages):
            store.pages[p].copy_(undo[i])
            if i == 0:
                point("recovery.undo_partial", chunk=chunk)
        return
    kinds = store.layout.update_kinds(int(store.layout.chunk_segment[chunk]))
    per_kind = len(pages) // len(kinds)
    span = min(saved, per_kind * store.layout.page_bytes)
    for k in range(len(kinds)):
        first = pages[k * per_kind]
        saved_copy = undo[k * per_kind : (k + 1) * per_kind].view(-1)[:span]
        store.pages[first : first + per_kind].view(-1)[:span].copy_(saved_copy)
        if k == 0:
            point("recovery.undo_partial", chunk=chunk)


def restore_whole_checked(store: RetainedStore, meta: Metadata, header, what: str) -> list[int]:
    """``restore_whole`` after checking the undo tail, then every restored page checked against
    its restored checksum: a damaged undo copy is refused, never resumed from. Returns the pages."""
    if tail_crc(store) != int(header[-1]):
        raise UnrecoverableDamageError({}, [f"rank {store.spec.rank}: segment {store.spec.name('undo')}: the backups "
                                            f"of checksums and step counters of {what} fail their checksum."])
    pages = restore_whole(store, int(header[1]))
    bad = [p for p in pages if not page_ok(store, p)]
    if bad:
        raise UnrecoverableDamageError({}, [f"rank {store.spec.rank}: segment {store.spec.name('undo')}: the undo "
                                            f"copy of {what} is damaged (pages {bad[:10]})."])
    meta.seal_all()
    return pages


def latest(store: RetainedStore) -> ProgressEntry | None:
    entries = read_all(store.record)
    return entries[-1].progress if entries else None


class RankProgress(NamedTuple):
    """One rank's progress record as recovery found it (before rolling forward): what the
    ranks of a job exchange to agree. A named tuple: it crosses nodes as a JSON list."""

    status: RecordStatus
    iteration: int
    open: bool = False  # inside a rollback window

    @classmethod
    def of(cls, value: Sequence[Any]) -> RankProgress:
        """From ``[status, iteration, open]`` as it arrives from another node."""
        return cls(RecordStatus(value[0]), int(value[1]), bool(value[2]) if len(value) > 2 else False)


class Agreement(NamedTuple):
    """The job-wide decision of the agree step."""

    target: int | None  # the newest iteration any rank prepared or committed
    everyone_reached: bool  # every rank of the job prepared or committed ``target``
    rollback: int | None  # an open iteration to roll back everywhere


def local_agreement(summary: Mapping[int, Sequence[Any] | None]) -> Agreement:
    """From ``{rank: RankProgress}`` (None: no record; a plain ``[status, iteration, open]``
    as it arrives from another node is read as one) of every rank of the job."""
    ranks = [None if s is None else RankProgress.of(s) for s in summary.values()]
    target = max((s.iteration for s in ranks if s is not None), default=None)
    opened = [s.iteration for s in ranks if s is not None and s.open]
    return Agreement(target, all(s is not None and s.iteration == target for s in ranks), min(opened, default=None))


def _summary(rec: ProgressEntry | None) -> RankProgress | None:
    return RankProgress(rec.status, rec.iteration, rec.open) if rec else None


def recover_node(stores: Mapping[int, RetainedStore], codes: ParityCodes | None = None,
                 agree: Callable[[dict], tuple[int | None, bool, int | None]] = local_agreement,
                 settings: ProcessSettings | None = None) -> dict[int, RecoveryReport]:
    """Recover the ranks of one node (keyed by local rank); see the module docstring.

    ``agree`` turns this node's ``{rank: RankProgress}`` into the job-wide
    decision (``local_agreement``: target iteration, whether every rank of the job prepared or
    committed it, an open iteration to roll back); a multi-node agent exchanges the summaries
    through the job's store before anything rolls forward or back. ``settings``
    (``ProcessSettings.from_env()`` where the caller reads the environment): whether a roll-forward
    may use the fused Adam kernel.

    Raises only ``LetoError``s: ``IncompleteStoreError`` (a store never finished set-up),
    ``UnrecoverableDamageError`` (damage beyond copies and parity), ``RecoveryError``; each
    means "resume from the last checkpoint". Anything else is a bug and surfaces as
    ``InternalError`` (never caught as a reason to fall back).
    """
    if not stores:
        raise ConfigurationError("recover_node needs at least one store: {local rank: RetainedStore.attach(job, rank)}")
    try:
        return _recover_node(stores, codes, agree, (settings or ProcessSettings()).fused_adam)
    except LetoError:
        raise
    except OSError as exc:  # the machine refused (shared memory gone, no space): the retained state is unusable
        raise RecoveryError(f"recovery of ranks {[s.spec.rank for s in stores.values()]} failed: "
                            f"{type(exc).__name__}: {exc}. {CHECKPOINT_ADVICE}") from exc
    except Exception as exc:  # a bug: it must surface, never pass as "resume from the checkpoint"
        raise InternalError(f"recovery of ranks {[s.spec.rank for s in stores.values()]} failed unexpectedly "
                            f"({type(exc).__name__}: {exc}); this is a bug in leto-lightning") from exc


def _recover_node(stores: Mapping[int, RetainedStore], codes: ParityCodes | None, agree,
                  fused_adam: bool = True) -> dict[int, RecoveryReport]:
    checked = {r: check_store(s) for r, s in stores.items()}
    codes = codes or ParityCodes(next(iter(stores.values())))
    reports = {r: RecoveryReport(rank=s.spec.rank, metadata_repaired=checked[r][1].repaired) for r, s in stores.items()}
    t0 = time.perf_counter()
    for r, store in stores.items():
        reports[r].restored = restore_in_flight(store, *checked[r])[0]
    point("recovery.restored")
    t1 = time.perf_counter()
    records = {r: _latest_checked(s) for r, s in stores.items()}
    for r, rec in records.items():
        reports[r].status_found, reports[r].iteration_found = rec.status, rec.iteration
    include_grads = {r for r, rec in records.items() if _needs_grads(stores[r], rec)}
    lost_grads = [r for r in include_grads if not checked[r][1].grads_known]
    if lost_grads:
        raise UnrecoverableDamageError({}, [f"rank {stores[r].spec.rank}: segment {stores[r].spec.name('meta')}: the "
                                            "gradients' checksums (both copies) are damaged and the prepared step "
                                            "needs the gradients to roll forward." for r in lost_grads])
    rep = repair(stores, codes.tier1, codes.tier2, include_grads)
    point("recovery.repaired")
    t2 = time.perf_counter()
    target, everyone, rollback = agree({stores[r].spec.rank: _summary(records[r]) for r in stores})
    if rollback is not None:
        for r, store in stores.items():
            roll_back(store, rollback, reports[r])
    groups1, stripes = verify_parity(stores, codes.tier1, codes.tier2, include_grads)
    point("recovery.parity_verified")
    t3 = time.perf_counter()
    if rollback is None:
        decide_and_roll_forward(stores, records, reports, codes, target, everyone, fused_adam)
    t4 = time.perf_counter()
    for r, report in reports.items():
        report.repair = rep
        report.reencoded_tier1 = groups1.get(r, [])
        report.reencoded_tier2 = stripes
        report.seconds = {"restore": t1 - t0, "verify_repair": t2 - t1, "reencode": t3 - t2, "roll_forward": t4 - t3}
    return reports


def _latest_checked(store: RetainedStore) -> ProgressEntry:
    """The newest intact progress record; a complete store always has one (set-up writes it)."""
    rec = latest(store)
    if rec is None:
        raise UnrecoverableDamageError({}, [f"rank {store.spec.rank}: segment {store.spec.name('meta')}: both "
                                            "progress-record slots fail their checksums."])
    return rec


def _needs_grads(store: RetainedStore, rec: ProgressEntry) -> bool:
    """A prepared step still to be rolled forward (some chunk not yet at its new version) needs
    the retained gradients; once every chunk committed -- or the next iteration already began
    and is rewriting them -- it does not, and damage there is no reason to give up."""
    if not rec.prepared or rec.open:
        return False
    return bool((store.versions() == rec.iteration).any())


def decide_and_roll_forward(stores, records, reports, codes: ParityCodes, target: int | None,
                            everyone_reached: bool, fused_adam: bool = True) -> None:
    for r, store in stores.items():
        rec, report = records[r], reports[r]
        if (rec.prepared and everyone_reached and store.layout.family == "generic"
                and not bool((store.versions() == rec.iteration + 1).all())):
            report.pending_step = True  # needs the optimizer object: RetainedOptimizer.bind(adopt=True)
            _check_versions(store, rec.iteration)
            report.committed_iteration = rec.iteration  # the step is re-run bit-identically on bind
            report.payload = rec.payload
            continue
        behind = target is not None and rec.iteration < target  # every other rank committed it already
        if rec.prepared and (everyone_reached or (behind and not rec.open)):
            report.rolled_forward = roll_forward(store, rec, codes, fused_adam)
            rec = dataclasses.replace(rec, status=RecordStatus.COMMITTED)
        elif rec.prepared:
            report.aborted = True
            rec = abort_prepared(store, rec)
        _check_versions(store, rec.iteration + 1 if rec.committed else rec.iteration)
        report.committed_iteration = rec.iteration if rec.committed else rec.iteration - 1
        report.payload = rec.payload


def roll_back(store: RetainedStore, t: int, report: RecoveryReport) -> list[int]:
    """Undo the open iteration ``t`` on this rank (module doc); returns the pages restored.

    The rank may be anywhere from "never prepared ``t``" to "sealed ``t`` and prepared
    ``t + 1``" (no further: ``t + 1``'s update waits for the open rank's prepare)."""
    entries = [e.progress for e in read_all(store.record)]
    if not entries or entries[-1].iteration < t:  # never prepared t: already where the job resumes
        _check_versions(store, t)
        report.committed_iteration, report.payload = (entries[-1].iteration, entries[-1].payload) if entries \
            else (t - 1, None)
        return []
    before = _payload_before(store, entries, t)
    pages: list[int] = []
    if bool((store.versions() == t + 1).all()):
        meta = Metadata(store)
        head = meta.read_header()
        chunk, version = header_fields(head)[:2] if head is not None else (None, None)
        if chunk != UNDO_WHOLE or version != t:
            raise RecoveryError(f"rank {store.spec.rank}: iteration {t} must be rolled back but the undo buffer holds "
                                f"{'the whole state' if chunk == UNDO_WHOLE else f'chunk {chunk}'} of iteration "
                                f"{version}. {CHECKPOINT_ADVICE}")
        pages = restore_whole_checked(store, meta, head, f"open iteration {t}")
    _check_versions(store, t)
    store.record.write(ProgressEntry(RecordStatus.COMMITTED, t - 1, before))
    report.rolled_back = True
    report.committed_iteration, report.payload = t - 1, before
    return pages


def _payload_before(store: RetainedStore, entries: list[ProgressEntry], t: int) -> object:
    """The payload a rank sealed before iteration ``t``: in ``t``'s open records, or kept as
    ``before`` in the records that sealed ``t``."""
    for rec in reversed(entries):
        if rec.iteration == t and rec.open:
            return rec.payload
        if rec.iteration == t and rec.has_before:
            return rec.before
    raise RecoveryError(f"rank {store.spec.rank}: iteration {t} must be rolled back but no record keeps the state "
                        "before it; resume from the last checkpoint")


def roll_forward(store: RetainedStore, rec: ProgressEntry, codes: ParityCodes, fused_adam: bool = True) -> list[int]:
    """Finish prepared iteration ``rec.iteration``: update the chunks still at its version, commit
    (``fused_adam``: the fused kernel may run, ``ProcessSettings.fused_adam``)."""
    t = rec.iteration
    versions = store.versions()
    pending = [c for c in range(store.layout.n_chunks) if int(versions[c]) == t]
    txn = ChunkTransactions(store, codes, pin_parity=False, fused_adam=fused_adam)
    txn.update_chunks(t, rec.hparams, rec.skip_params, chunks=pending)
    txn.commit(t, rec.payload)
    return pending


def abort_prepared(store: RetainedStore, rec: ProgressEntry) -> ProgressEntry:
    """Undo a prepare that not every rank reached: nothing of it may have committed."""
    t = rec.iteration
    if bool((store.versions() == t + 1).any()):
        raise RecoveryError(f"rank {store.spec.rank}: iteration {t} must be aborted (a peer never prepared it) but "
                            "chunks of it already committed: the prepare barrier was not respected")
    earlier = [e.progress for e in read_all(store.record) if e.progress.committed]
    previous = earlier[-1] if earlier else ProgressEntry(RecordStatus.COMMITTED, t - 1, None)
    store.record.write(previous)
    return previous


def _check_versions(store: RetainedStore, expected: int) -> None:
    versions = store.versions()
    wrong = (versions != expected).nonzero().flatten().tolist()
    if wrong:
        raise RecoveryError(
            f"rank {store.spec.rank}: chunks {wrong[:10]} are at versions "
            f"{sorted({int(versions[c]) for c in wrong})}, expected {expected} everywhere (the progress record and "
            f"the commit marks disagree). {CHECKPOINT_ADVICE}"
        )
