"""Which agent holds each node slot of the job, whether it is alive, and the spare pool.

A job launched with ``--spares K`` has ``nnodes`` node slots and ``K`` spare agents (launch node
ranks ``nnodes .. nnodes + K - 1``). Every agent, training or spare, beats: a thread of its own,
on a store connection of its own (``AgentBeat``), bumps ``keys.AGENT_BEAT`` every
``beat_interval``, so that a long recovery step never makes its agent look dead. A watcher tells
another agent alive by its beat *changing*, timed on the watcher's own clock (clock skew between
machines does not matter), as the agent tells a trainer's heartbeat.

A slot is **lost** when the beat of the agent holding it has not changed for ``node_timeout``
seconds (``startup_timeout`` before its first beat): its machine, its retained memory and its
devices count as gone. An agent whose own failure was not a HOF (its device is not operable)
*retires* its node (``keys.RETIRED``): lost at once. Slot 0 is never replaced: its agent hosts
the job's store, and losing it ends the store (and the job) for everyone.

A lost slot gets a spare (``claim_spare``): the first alive spare whose assignment key
(``keys.SPARE_ASSIGN``, first writer wins) takes this slot's ``NodeAssignment``. Every surviving
agent runs the same claim and so agrees on the spare; a spare assigned once stays used. No
alive unused spare: ``None`` (the job cannot go on at its size).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .control import SignedStore
from .keys import AGENT_BEAT, JOB_OVER, RETIRED, SLOT_HOLDER, SPARE_ASSIGN
from .messages import NodeAssignment
from .spec import LaunchSpec

log = logging.getLogger(__name__)


class AgentBeat:
    """This agent's beat (module doc), until ``close``; a store that went away ends it quietly
    (the job is over, or node 0 is gone: the watchers see that themselves)."""

    def __init__(self, store: SignedStore, launch: int, interval: float) -> None:
        self._store, self._key, self._interval = store, AGENT_BEAT.format(launch=launch), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"leto-agent-beat-{launch}", daemon=True)

    def start(self) -> AgentBeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self._store.set(self._key, str(count))
            except (dist.DistError, OSError, RuntimeError):
                return
            self._stop.wait(self._interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class Membership:
    """This agent's view of who holds which slot and who is alive (module doc)."""

    def __init__(self, store: SignedStore, spec: LaunchSpec, node_timeout: float, startup_timeout: float) -> None:
        self.store, self.nnodes, self.launch = store, spec.nnodes, spec.node_rank
        self.spares = list(range(spec.nnodes, spec.nnodes + spec.spares))
        self.slot: int | None = None if spec.is_spare else spec.node_rank  # what this agent holds
        self.node_timeout, self.startup_timeout = node_timeout, startup_timeout
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # launch rank -> (last beat, since when)
        self._interval = beat_interval(node_timeout)
        self._polled = 0.0
        self._lost: list[int] = []

    @property
    def watching(self) -> bool:
        """Only a job with spares watches its agents: without one a lost node has no remedy here
        (its trainers' peers fail, and the job restarts from the checkpoint or stops)."""
        return bool(self.spares)

    def holder(self, node: int) -> int:
        """The launch rank of the agent holding slot ``node`` now."""
        raw = self.store.read(SLOT_HOLDER.format(node=node))
        return node if raw is None else NodeAssignment.from_json(raw).spare

    def lost(self) -> list[int]:
        """The slots (other than this agent's) whose holder stopped beating; re-read at most
        once per beat interval."""
        now = time.monotonic()
        if self.watching and now - self._polled >= self._interval:
            self._polled = now
            holders = {n: self.holder(n) for n in range(self.nnodes) if n != self.slot}
            self._lost = [n for n, agent in holders.items()  # alive() first: it records every beat seen
                          if not self.alive(agent, now) or self.store.read(RETIRED.format(launch=agent)) is not None]
            for spare in self.spares:  # so that a spare dead before it was needed is never claimed
                if spare != self.launch:
                    self.alive(spare, now)
        return list(self._lost)

    def alive(self, launch: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        beat = self.store.read(AGENT_BEAT.format(launch=launch))
        seen = self._seen.get(launch)
        if seen is None or seen[0] != beat:
            self._seen[launch] = (beat, now)
            return True
        limit = self.node_timeout if beat is not None else self.startup_timeout
        return now - seen[1] <= limit

    def free_spares(self) -> list[int]:
        """The spares alive and not yet assigned (as this agent sees them now)."""
        return [s for s in self.spares if self.store.read(SPARE_ASSIGN.format(launch=s)) is None and self.alive(s)]

    def retire(self) -> None:
        """This agent takes its node out of the job (its device is not operable): the others
        count its slot lost at once instead of after the node timeout."""
        self.store.set(RETIRED.format(launch=self.launch), "1")

    def claim_spare(self, node: int, generation: int) -> NodeAssignment | None:
        """The spare that takes over slot ``node`` in ``generation`` (module doc), or None."""
        for spare in self.spares:
            key = SPARE_ASSIGN.format(launch=spare)
            taken = self.store.read(key)
            if taken is None and not self.alive(spare):
                continue
            mine = NodeAssignment(node, generation, spare)
            got = NodeAssignment.from_json(self.store.compare_set(key, "", mine.to_json()))
            if got == mine:
                self.store.set(SLOT_HOLDER.format(node=node), mine.to_json())
                self._lost = [n for n in self._lost if n != node]  # held by a live agent again
                return mine
        return None

    def wait_assignment(self, check_stop: Callable[[], None], poll_s: float) -> NodeAssignment | None:
        """A spare: wait until a slot is assigned to it; None once the job is over (or its store
        is gone)."""
        key = SPARE_ASSIGN.format(launch=self.launch)
        while True:
            check_stop()
            try:
                raw = self.store.read(key)
                if raw is not None:
                    assignment = NodeAssignment.from_json(raw)
                    self.slot = assignment.node
                    return assignment
                if self.store.read(JOB_OVER) is not None:
                    return None
            except (dist.DistNetworkError, ConnectionError):
                return None
            time.sleep(poll_s)


def beat_interval(node_timeout: float) -> float:
    """How often an agent beats and watches: several beats fit in a node timeout."""
    return min(1.0, node_timeout / 5)
