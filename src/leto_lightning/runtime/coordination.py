"""What the parts of one agent share: the stop flag, the job's identity, the nodes' lockstep.

- ``StopFlag``: a stop request (SIGINT/SIGTERM to the launcher); every wait of the agent polls
  it, so a stop wins over any step (a recovery included) within about a poll interval.
- ``JobIdentity``: the retained-memory job id and the generation (Leto's restart count) the
  agent runs now; only ``Recovery`` advances them.
- ``NodeLockstep``: the points where the agents of a multi-node job wait for each other
  through the job's store (a recovery's steps, the end of the job, per-rank job ids).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .control import SignedStore
from .keys import JOB_ID, JOB_OVER, NODE_DONE, NODE_STEP
from .messages import M
from .phases import JobInterrupted, JobStopped, NodeLost
from .spec import LaunchSpec

if TYPE_CHECKING:
    from .membership import Membership


class StopFlag:
    """Set by the signal handler; ``check`` raises ``JobInterrupted`` once it is set."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._signum: int | None = None

    def request(self, signum: int) -> None:
        self._signum = signum
        self._event.set()

    def check(self) -> None:
        """A stop request wins over any step of the job (recovery included): called by every wait."""
        if self._event.is_set():
            raise JobInterrupted(self._signum or signal.SIGTERM)

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; returns at once when a stop is requested."""
        self._event.wait(seconds)


@dataclass
class JobIdentity:
    """The retained-memory job id and generation of this agent's job now."""

    job_id: str
    generation: int = 0
    all_job_ids: list[str] = field(default_factory=list)  # every id used: shutdown frees them all

    def __post_init__(self) -> None:
        self.all_job_ids = [self.job_id]

    def agreed(self, job_id: str) -> None:
        """The id every agent agreed on at start (replaces the one drawn locally)."""
        self.job_id = job_id
        self.all_job_ids = [job_id]

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    def replace_job_id(self, job_id: str) -> None:
        """A checkpoint restart: new retained memory under a new id."""
        self.job_id = job_id
        self.all_job_ids.append(job_id)


class NodeLockstep:
    """The job's node agents waiting for each other through the store."""

    def __init__(self, store: SignedStore, spec: LaunchSpec, job: JobIdentity, stop: StopFlag,
                 timeout_s: float, poll_s: float, membership: Membership | None = None) -> None:
        self.store, self.spec, self.job, self.stop = store, spec, job, stop
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.membership = membership  # a job with spares: a lost node ends a wait (NodeLost)

    def wait_keys(self, names: list[str], what: str, nodes: list[int] | None = None) -> None:
        """Wait (at most the start-up timeout) until the store has ``names``; a stop request ends
        it, and so does the loss of a node whose key (``names[i]`` is node ``nodes[i]``'s) is missing."""
        deadline = time.time() + self.timeout_s
        while not self.store.check(names):
            self.stop.check()
            self._check_lost(names, nodes)
            if time.time() > deadline:
                raise JobStopped(f"waited {self.timeout_s:.0f} s for {what} (--startup-timeout); "
                                 "is another node's agent gone?")
            self.stop.wait(self.poll_s)

    def _check_lost(self, names: list[str], nodes: list[int] | None) -> None:
        if self.membership is None or nodes is None:
            return
        lost = [n for name, n in zip(names, nodes) if n in self.membership.lost() and not self.store.check([name])]
        if lost:
            raise NodeLost(lost)

    def sync(self, message: M) -> list[M]:
        """Lockstep point of a recovery across the job's node agents (the step is the message's
        type); returns every node's message, node by node."""
        gen, nodes, step = self.job.generation, range(self.spec.nnodes), message.STEP
        self.store.set(NODE_STEP.format(gen=gen, step=step, node=self.spec.node_rank), json.dumps(message.to_dict()))
        names = [NODE_STEP.format(gen=gen, step=step, node=n) for n in nodes]
        while True:
            self.wait_keys(names, f"every node's agent to reach recovery step {step!r}", list(nodes))
            values = [self.store.read(k) for k in names]
            if all(v is not None for v in values):  # else one vanished after the check: wait again
                return [type(message).from_dict(json.loads(v)) for v in values if v is not None]

    def shared_job_id(self, mine: str) -> str:
        """Per-rank agents agree on one retained-memory job id per start (first writer wins):
        the trainers of a node's ranks attach each other's stores for tier-2 parity."""
        if self.spec.trainer_layout is None:
            return mine
        got = self.store.compare_set(JOB_ID.format(gen=self.job.generation), "", mine)
        return got.decode() if isinstance(got, bytes) else str(got)

    def wait_other_nodes_done(self) -> None:
        """Node 0 hosts the store: it stays up until every node's trainers finished."""
        if self.spec.nnodes == 1:
            return
        self.store.set(NODE_DONE.format(node=self.spec.node_rank), "1")
        if self.spec.node_rank == 0:
            every_node = [NODE_DONE.format(node=n) for n in range(self.spec.nnodes)]
            self.wait_keys(every_node, "every node's trainers to finish")
            self.store.set(JOB_OVER, "1")  # spares still waiting exit
