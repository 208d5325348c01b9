"""Two node agents on one machine (loopback): the job-wide failure verdict, lockstep recovery
and the roll-forward agreement go through the TCPStore exactly as across real nodes."""

from __future__ import annotations

import os

from .harness import finish, free_port, same_state, start
from .test_inplace_recovery import ITERATIONS, reference  # noqa: F401  (the fixture)


def test_two_nodes_recover_in_lockstep(tmp_path, reference, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LETO_SECRET", os.urandom(16).hex())  # every node's agent: the same control-plane secret
    port = free_port()
    faults = [{"id": 0, "rank": 1, "iteration": 11, "point": "chunk.math_done", "occurrence": 2,
               "wait_shadows": True}]
    procs = []
    for node in (0, 1):
        extra = ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port)]
        procs.append(start(tmp_path / f"node{node}", ITERATIONS, faults=faults, extra=extra, nproc=1))
    results = [finish(p, tmp_path / f"node{n}") for n, p in enumerate(procs)]
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
        (done,) = r.of("recovery_finished")
        assert done["promoted"] == "shadow" and done["resume_iteration"] == 12
    # node 0 learnt of the failure from node 1's verdict in the store
    (verdict,) = results[0].of("classification")
    assert verdict["node"] == 1 and verdict["hof"]
    for rank, result in enumerate(results):
        assert same_state(result.final(rank), reference.final(rank)) == []
