"""The repair step of an in-place recovery: this node's retained stores, agreed with the others.

``repair_node_stores`` attaches the stores this agent repairs (``LaunchSpec.repair_ranks``)
and runs ``updater.recovery.recover_node`` on them. Its roll-forward / abort / rollback
decision is job-wide: each node sends a ``NodeSummary`` of its ranks' progress records and
decides from every node's (``updater.recovery.local_agreement``). A node that fails before it
could send one sends ``NodeSummary(failed=...)`` instead, so that the others do not wait for it
and give up too (``RetainedStateError``: every node restarts from the checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..env import ProcessSettings
from ..errors import RetainedStateError
from ..retained.store import RetainedStore
from ..updater.recovery import Agreement, RankProgress, RecoveryReport, local_agreement, recover_node
from .coordination import NodeLockstep
from .messages import NodeSummary
from .spec import LaunchSpec


@dataclass(frozen=True)
class RepairOutcome:
    """What the job learnt from every node's repair step."""

    reports: dict[int, RecoveryReport]  # this node's stores (by local rank)
    resume_iteration: int | None  # the job's (the smallest of every node's)
    problem: str | None  # why the retained state cannot be used (the first node's reason), or None


class SummaryExchange:
    """The ``agree`` callback of ``recover_node`` across the job's nodes."""

    def __init__(self, node: int, lockstep: NodeLockstep) -> None:
        self.node, self.lockstep = node, lockstep
        self.sent = False

    def agree(self, summary: Mapping[int, RankProgress | None]) -> Agreement:
        """The job-wide decision from every node's ``{rank: RankProgress}``."""
        return local_agreement(self._merge(NodeSummary(self.node, tuple(summary.items()))))

    def fail(self, reason: str) -> None:
        """This node cannot send a summary: unblock the others (once)."""
        if not self.sent:
            self.sent = True
            self.lockstep.sync(NodeSummary(self.node, failed=reason))

    def _merge(self, mine: NodeSummary) -> dict[int, RankProgress | None]:
        self.sent = True
        merged: dict[int, RankProgress | None] = {}
        for node in self.lockstep.sync(mine):
            if node.failed is not None:
                raise RetainedStateError(f"retained state unusable on another node ({node.failed})")
            merged.update(node.ranks)
        return merged


def repair_node_stores(job_id: str, spec: LaunchSpec, lockstep: NodeLockstep) -> dict[int, RecoveryReport]:
    """Attach, check, repair and roll forward this node's stores; ``RetainedStateError`` (or a
    ``FileNotFoundError`` for a segment removed from /dev/shm) when they cannot be used."""
    exchange = SummaryExchange(spec.node_rank, lockstep)
    ranks = spec.repair_ranks
    if not ranks:  # a per-rank agent that repairs nothing still takes part in the agreement
        exchange.agree({})
        return {}
    stores: dict[int, RetainedStore] = {}
    try:
        for local, rank in enumerate(ranks):
            stores[local] = RetainedStore.attach(job_id, rank)
        return recover_node(stores, agree=exchange.agree, settings=ProcessSettings.from_env())
    except Exception as exc:  # re-raised: the other nodes wait for this node's summary, unblock them first
        exchange.fail(f"node {spec.node_rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        for s in stores.values():
            s.close()
