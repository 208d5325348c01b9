"""Checksums and a second copy for every metadata word recovery reads.

The meta segment holds a *primary* copy (what the trainer's views use) and a *mirror*. Each
piece of metadata has a checksum word in both copies:

- per chunk: its commit mark (version), the step counters of its pieces and the checksums of
  the pages it updates -- one word, written last when the chunk commits (the commit point);
- the gradients' page checksums (written at prepare);
- the scalar state and flags (generic optimizers).

Write order, so a SIGKILL anywhere leaves at least one valid copy of the last committed state:
the primary is changed (its checksum goes invalid), its checksum word is written (valid again,
new contents), then the mirror is copied from it. A reader takes the primary when valid, else the
mirror; the primary is never older than the mirror.

The undo header is written twice too, each copy with a sequence number and a checksum; the valid
copy with the highest sequence names the chunk in flight. A chunk is in flight exactly when the
header names it and its primary commit mark does not validate at the header's version + 1 --
the phase column of the chunk table is only a report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..faults.points import point
from .spec import UNDO_CHUNK, UNDO_CRCS, UNDO_NPAGES, UNDO_NPIECES, UNDO_VERSION, words_crc

GRAD_SEED = -2  # checksum seeds of the non-chunk sums
STATE_SEED = -3
HEADER_SEED = -4


class MetaCopy:
    """numpy views of one copy (primary or mirror) of a store's metadata."""

    def __init__(self, versions, steps, crcs, scalars, flags, sums) -> None:
        self.versions, self.steps, self.crcs = versions, steps, crcs
        self.scalars, self.flags, self.sums = scalars, flags, sums


class Metadata:
    """The checked metadata of one store: sums, mirroring, the undo header's two copies."""

    def __init__(self, store) -> None:
        lay = store.layout
        self.store = store
        self.n_chunks = lay.n_chunks
        self.primary = MetaCopy(store.chunk_table.numpy()[:, 0], store.steps.numpy(), store.crcs.numpy(),
                                store.scalars.numpy().reshape(-1), store.flags.numpy(), store.sums.numpy())
        m = store.mirror
        self.mirror = MetaCopy(m["versions"].numpy(), m["steps"].numpy().view(np.float32)[: lay.n_pieces],
                               m["crcs"].numpy(), m["scalars"].numpy().view(np.float32)[: store.scalars.numel()],
                               m["flags"].numpy(), m["sums"].numpy())
        self._pages = [np.asarray(lay.chunk_pages_updated(c), dtype=np.int64) for c in range(lay.n_chunks)]
        self._pieces = [slice(lay.chunk_first_piece[c], lay.chunk_first_piece[c] + len(lay.chunk_pieces[c]))
                        for c in range(lay.n_chunks)]
        grads = [p for p in range(lay.n_pages) if lay.page_kind[p] == "grad"]
        self._grad_pages = np.asarray(grads, dtype=np.int64)
        self._heads = tuple(h.numpy() for h in store.undo_copies)
        self._head_words = store.spec.undo_header_words

    # -- sums ----------------------------------------------------------------------------------
    def chunk_sum(self, copy: MetaCopy, c: int) -> int:
        return words_crc(c, copy.versions[c : c + 1], copy.steps[self._pieces[c]], copy.crcs[self._pages[c]])

    def grad_sum(self, copy: MetaCopy) -> int:
        return words_crc(GRAD_SEED, copy.crcs[self._grad_pages])

    def state_sum(self, copy: MetaCopy) -> int:
        return words_crc(STATE_SEED, copy.scalars, copy.flags)

    def chunk_valid(self, copy: MetaCopy, c: int) -> bool:
        return int(copy.sums[c]) == self.chunk_sum(copy, c)

    def grads_valid(self, copy: MetaCopy) -> bool:
        return int(copy.sums[self.n_chunks]) == self.grad_sum(copy)

    def state_valid(self, copy: MetaCopy) -> bool:
        return int(copy.sums[self.n_chunks + 1]) == self.state_sum(copy)

    # -- writing (the update path) -------------------------------------------------------------
    def seal_chunk(self, c: int) -> None:
        """The primary checksum of chunk ``c``: written last, it is the chunk's commit point."""
        self.primary.sums[c] = self.chunk_sum(self.primary, c)

    def mirror_chunk(self, c: int) -> None:
        p, m, pages, pieces = self.primary, self.mirror, self._pages[c], self._pieces[c]
        m.versions[c] = p.versions[c]
        m.steps[pieces] = p.steps[pieces]
        m.crcs[pages] = p.crcs[pages]
        m.sums[c] = p.sums[c]

    def seal_grads(self) -> None:
        self.primary.sums[self.n_chunks] = self.grad_sum(self.primary)
        self.mirror.crcs[self._grad_pages] = self.primary.crcs[self._grad_pages]
        self.mirror.sums[self.n_chunks] = self.primary.sums[self.n_chunks]

    def seal_all(self) -> None:
        """Checksum and mirror everything (a new store, a whole-state commit, after recovery).
        The scalar state is sealed before the chunks: the last chunk's sum is the commit point."""
        p = self.primary
        p.sums[self.n_chunks + 1] = self.state_sum(p)
        p.sums[self.n_chunks] = self.grad_sum(p)
        for c in range(self.n_chunks):
            self.seal_chunk(c)
        self.mirror_all()

    def mirror_all(self) -> None:
        p, m = self.primary, self.mirror
        m.versions[:] = p.versions
        m.steps[:] = p.steps
        m.crcs[:] = p.crcs
        m.scalars[:] = p.scalars
        m.flags[:] = p.flags
        m.sums[:] = p.sums

    # -- the undo header -----------------------------------------------------------------------
    def write_header(self, words: np.ndarray) -> None:
        """Both copies of the undo header (``words``: chunk, version, n_pages, n_pieces, ...),
        one after the other, each with the next sequence number and its checksum. The number is
        read back each time: a shadow's transactions start after another process wrote headers."""
        seq = self._newest_seq() + 1
        n = self._head_words
        for head in self._heads:
            head[n + 1] = 0  # invalid while it is rewritten
            head[:n] = 0
            head[: len(words)] = words
            head[n] = seq
            head[n + 1] = words_crc(HEADER_SEED, head[: n + 1])

    def _newest_seq(self) -> int:
        return max((s for s in (self._head_seq(i) for i in range(2)) if s is not None), default=0)

    def _head_seq(self, i: int) -> int | None:
        head, n = self._heads[i], self._head_words
        return int(head[n]) if int(head[n + 1]) == words_crc(HEADER_SEED, head[: n + 1]) else None

    def read_header(self) -> np.ndarray | None:
        """The newest intact undo header (a copy of its words), or None when neither copy is."""
        best = None
        for i in range(2):
            seq = self._head_seq(i)
            if seq is not None and (best is None or seq > best[0]):
                best = (seq, i)
        return None if best is None else self._heads[best[1]][: self._head_words].copy()

    def repair_header(self) -> list[int]:
        """Rewrite each copy that is not the newest intact one from it (damaged, or left older by a
        write killed between the copies); returns the copies rewritten. The source copy is never
        written, so a kill here leaves at least the intact copy there was."""
        seqs = [self._head_seq(i) for i in range(2)]
        if seqs[0] is None and seqs[1] is None:
            return []
        best = 0 if seqs[1] is None or (seqs[0] is not None and seqs[0] >= seqs[1]) else 1
        source, n, done = self._heads[best], self._head_words + 2, []
        for i in range(2):
            target = self._heads[i]
            if i != best and not np.array_equal(target[:n], source[:n]):
                target[n - 1] = 0  # invalid while it is rewritten
                target[: n - 1] = source[: n - 1]
                point("recovery.copy_rewrite", what="undo header", copy=i)
                target[n - 1] = source[n - 1]
                done.append(i)
        return done


@dataclass
class MetaVerdict:
    """What ``check_metadata`` found: the header, the chunk(s) in flight, what it repaired."""

    header: np.ndarray | None
    in_flight: list[int] = field(default_factory=list)  # chunk indices; [-1]: the whole state
    repaired: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # beyond both copies (each names segment and word)
    grads_known: bool = True


def check_metadata(meta: Metadata, undo_whole: int) -> MetaVerdict:
    """Verify both copies of every metadata item, repair one from the other, and find the chunk(s)
    in flight. Items lost in both copies are listed in ``lost`` (the caller raises)."""
    store = meta.store
    name = store.spec.name("meta")
    header = meta.read_header()
    verdict = MetaVerdict(header)
    damaged_heads = [i for i in range(2) if meta._head_seq(i) is None]
    rewritten = meta.repair_header()
    verdict.repaired += [f"segment {name}: undo header copy {i} (rewritten)" for i in rewritten if i in damaged_heads]
    p, m = meta.primary, meta.mirror
    chunk = int(header[UNDO_CHUNK]) if header is not None else None
    version = int(header[UNDO_VERSION]) if header is not None else -1  # -1: unused, no chunk then
    if chunk == undo_whole:
        if not _whole_committed(meta, version):
            verdict.in_flight = [undo_whole]
    elif chunk is not None and 0 <= chunk < meta.n_chunks:
        if not (_committed(meta, p, chunk, version) or _committed(meta, m, chunk, version)):
            verdict.in_flight = [chunk]
    elif chunk is not None:
        verdict.lost.append(f"segment {name}: the undo header names chunk {chunk} of {meta.n_chunks}")
    whole = verdict.in_flight == [undo_whole]
    for c in range(meta.n_chunks):
        if c in verdict.in_flight or whole:
            continue  # rebuilt from the undo buffer
        _settle_item(meta, verdict, f"segment {name}: metadata of chunk {c} (commit mark, step counters, page "
                     "checksums)", lambda cp, c=c: meta.chunk_valid(cp, c),
                     lambda c=c: meta.mirror_chunk(c), lambda c=c: _copy_chunk_back(meta, c))
    verdict.grads_known = _settle_item(meta, verdict, None, meta.grads_valid, meta.seal_grads,
                                       lambda: _copy_grads_back(meta))
    if not whole:
        _settle_item(meta, verdict, f"segment {name}: scalar optimizer state and flags", meta.state_valid,
                     lambda: _mirror_state(meta), lambda: _copy_state_back(meta))
    if header is None and bool((store.chunk_table[:, 1] != 0).any()):
        verdict.lost.append(f"segment {name}: undo header (both copies) while chunks "
                            f"{store.in_flight()[:8]} are marked in flight")
    return verdict


def _committed(meta: Metadata, copy: MetaCopy, c: int, version: int) -> bool:
    return meta.chunk_valid(copy, c) and int(copy.versions[c]) == version + 1


def _whole_committed(meta: Metadata, version: int) -> bool:
    """Did the whole-state transaction at ``version`` commit? Decided item by item, so damage to
    one copy of one item and the other copy of another still leaves the answer:

    - every chunk's commit mark shows ``version + 1`` in a valid copy, primary or mirror (the
      primaries are sealed in chunk order, the last one is the commit point, and the mirror is
      written only after it: a chunk still uncommitted has neither copy at ``version + 1``);
    - the scalar state is valid in a copy known to hold its new values: the primary's (the step
      is done, so it holds the new values; it is sealed first at the commit), or the mirror's
      once the mirror was written after the commit (some mirror chunk valid at ``version + 1``
      says so; before that it may be older)."""
    chunks = range(meta.n_chunks)
    mirrored = [_committed(meta, meta.mirror, c, version) for c in chunks]
    if not all(m or _committed(meta, meta.primary, c, version) for c, m in zip(chunks, mirrored)):
        return False
    return meta.state_valid(meta.primary) or (meta.state_valid(meta.mirror) and any(mirrored))


def _settle_item(meta: Metadata, verdict: MetaVerdict, what: str | None, valid, to_mirror, to_primary) -> bool:
    """Primary valid: refresh the mirror from it; else mirror valid: copy it back; else lost."""
    p_ok, m_ok = valid(meta.primary), valid(meta.mirror)
    if p_ok:
        to_mirror()
        if not m_ok and what:
            verdict.repaired.append(what + " (mirror)")
        return True
    if m_ok:
        to_primary()
        if what:
            verdict.repaired.append(what + " (primary)")
        return True
    if what:
        verdict.lost.append(what + ": both copies fail their checksums")
    return False


def _copy_chunk_back(meta: Metadata, c: int) -> None:
    p, m, pages, pieces = meta.primary, meta.mirror, meta._pages[c], meta._pieces[c]
    p.versions[c] = m.versions[c]
    p.steps[pieces] = m.steps[pieces]
    p.crcs[pages] = m.crcs[pages]
    p.sums[c] = m.sums[c]


def _copy_grads_back(meta: Metadata) -> None:
    g = meta._grad_pages
    meta.primary.crcs[g] = meta.mirror.crcs[g]
    meta.primary.sums[meta.n_chunks] = meta.mirror.sums[meta.n_chunks]


def _mirror_state(meta: Metadata) -> None:
    meta.mirror.scalars[:] = meta.primary.scalars
    meta.mirror.flags[:] = meta.primary.flags
    meta.mirror.sums[meta.n_chunks + 1] = meta.primary.sums[meta.n_chunks + 1]


def _copy_state_back(meta: Metadata) -> None:
    meta.primary.scalars[:] = meta.mirror.scalars
    meta.primary.flags[:] = meta.mirror.flags
    meta.primary.sums[meta.n_chunks + 1] = meta.mirror.sums[meta.n_chunks + 1]


def header_fields(header: np.ndarray) -> tuple[int, int, int, int]:
    """(chunk, version, n_pages, n_pieces) of an undo header."""
    return (int(header[UNDO_CHUNK]), int(header[UNDO_VERSION]), int(header[UNDO_NPAGES]),
            int(header[UNDO_NPIECES]))


__all__ = ["UNDO_CRCS", "MetaVerdict", "Metadata", "check_metadata", "header_fields"]
