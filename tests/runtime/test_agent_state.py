"""The agent's explicit state and typed protocols, without launching a job (well under a second).

- every ``JobPhase`` / ``RecoveryPhase`` transition the docstring of ``runtime/phases.py`` lists
  is allowed, every other one raises ``IllegalTransition`` (an ``InternalError``: a bug, never a
  fallback), and the phase stays where it was;
- the store messages read back what was written;
- a store timeout is told from a lost store host by the exception's type, on a real TCPStore.
"""

from __future__ import annotations

import gc
import itertools
import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from leto_lightning.errors import InternalError, LetoTimeoutError, RetainedStateError
from leto_lightning.retained.record import RecordStatus
from leto_lightning.runtime.control import SignedStore, host_store, is_store_timeout, store_timeouts
from leto_lightning.runtime.messages import Heartbeat, NodeSummary, Promotion, ResumeInfo, Verdict
from leto_lightning.runtime.phases import (
    JOB_TRANSITIONS,
    RECOVERY_TRANSITIONS,
    IllegalTransition,
    JobPhase,
    PhaseTracker,
    RecoveryPhase,
)
from leto_lightning.updater.recovery import RankProgress

# The tables as the docstring of runtime/phases.py writes them down.
JOB_DOC = {
    "STARTING": "RUNNING STOPPED INTERRUPTED",
    "RUNNING": "RECOVERING FINISHED STOPPED INTERRUPTED",
    "RECOVERING": "RUNNING STOPPED INTERRUPTED",
    "FINISHED": "", "STOPPED": "", "INTERRUPTED": "",
}
RECOVERY_DOC = {
    "IDLE": "CLASSIFYING",
    "CLASSIFYING": "STOPPING RESTARTING",
    "STOPPING": "REPAIRING CLASSIFYING",
    "REPAIRING": "PROMOTING RESTARTING CLASSIFYING",
    "PROMOTING": "RESUMING CLASSIFYING",
    "RESUMING": "CONFIRMING CLASSIFYING",
    "CONFIRMING": "IDLE CLASSIFYING",
    "RESTARTING": "IDLE",
}


@pytest.mark.parametrize(("kind", "table", "doc"), [(JobPhase, JOB_TRANSITIONS, JOB_DOC),
                                                     (RecoveryPhase, RECOVERY_TRANSITIONS, RECOVERY_DOC)])
def test_every_listed_transition_is_allowed_and_every_other_raises(kind, table, doc) -> None:
    assert {p.name: " ".join(sorted(n.name for n in table[p])) for p in kind} == {
        k: " ".join(sorted(v.split())) for k, v in doc.items()}
    for old, new in itertools.product(kind, kind):
        tracker = PhaseTracker("test", old, table)
        if new.name in doc[old.name].split():
            assert tracker.advance(new) is old and tracker.current is new
        else:
            with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name} is not allowed"):
                tracker.advance(new)
            assert tracker.current is old


def test_an_illegal_transition_is_a_bug_not_a_fallback() -> None:
    assert issubclass(IllegalTransition, InternalError)
    assert not issubclass(IllegalTransition, RetainedStateError)  # the agent's one fallback branch
    with pytest.raises(InternalError, match="no transitions listed"):
        PhaseTracker("job", JobPhase.STARTING, {JobPhase.STARTING: frozenset()})


def test_store_messages_read_back_what_was_written() -> None:
    beat = Heartbeat(t=1.5, it=7, phase="update", pid=42, gen=2)
    assert Heartbeat.from_json(beat.to_json()) == beat and Heartbeat.from_json(b"") is None
    info = ResumeInfo(init_s=0.25, resume_s=0.5, iteration=9, t=3.0)
    assert ResumeInfo.from_json(info.to_json().encode()) == info
    verdict = Verdict(rank=1, hof=True, reason="trainer killed", device="CPU job", node=0)
    assert Verdict.from_json(verdict.to_json()) == verdict
    assert Promotion.from_json(Promotion(generation=4).to_json()) == Promotion(4)
    summary = NodeSummary(1, ((2, RankProgress.of(["prepared", 5, True])), (3, None)))
    assert NodeSummary.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    assert summary.ranks[0][1] == RankProgress(RecordStatus.PREPARED, 5, True)
    assert NodeSummary.from_dict(NodeSummary(0, failed="node 0: boom").to_dict()).failed == "node 0: boom"


def test_store_timeouts_are_told_by_type_from_a_lost_store() -> None:
    master, port = host_store("127.0.0.1", 0, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    signed = SignedStore(client, b"k" * 32)
    with pytest.raises(dist.DistStoreError) as timed_out:
        client.wait(["never"], timedelta(milliseconds=100))
    assert is_store_timeout(timed_out.value)
    with pytest.raises(LetoTimeoutError, match="waiting for it"), store_timeouts("waiting for it"):
        client.wait(["never"], timedelta(milliseconds=100))
    with pytest.raises(LetoTimeoutError):
        signed.wait(["never"], timedelta(milliseconds=100))
    del master  # the host is gone: not a timeout, and not turned into one
    gc.collect()
    with pytest.raises(dist.DistNetworkError) as lost:
        client.wait(["never"], timedelta(milliseconds=100))
    assert not is_store_timeout(lost.value)
    with pytest.raises(dist.DistNetworkError), store_timeouts("waiting for it"):
        client.wait(["never"], timedelta(milliseconds=100))
    assert not is_store_timeout(dist.QueueEmptyError("empty"))


def test_each_lockstep_step_carries_one_message_type() -> None:
    """``NodeLockstep.sync`` takes a message and gives back the same type from every node: the
    step's name is the type's (no raw dicts cross between agents)."""
    from leto_lightning.runtime.messages import NodeRecovered, NodeShadowsReady, NodeStopped

    messages = [NodeStopped(), NodeRecovered("disk gone", None), NodeRecovered(None, 12), NodeShadowsReady(True),
                NodeSummary(0, ((0, None),), None)]
    for m in messages:
        assert type(m).from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert len({type(m).STEP for m in messages}) == 4  # one step name per type
