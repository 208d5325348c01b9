"""torchrun and srun under ``LetoStrategy``: every process they start becomes its rank's agent.

Both launchers stop every rank when one of their processes dies -- the failure Leto recovers
from in place. So the process a launcher starts for a rank never trains: when the strategy is
built (``Trainer(...)``), it ``exec``s itself into ``leto launch`` supervising that one rank.
The pid stays, so torchrun/srun see their worker alive; the agent's exit status becomes the
worker's. The agent runs the rank's active and shadow trainers as its children and recovers
them; the launcher never sees a rank die.

The Leto job then has WORLD_SIZE one-rank "nodes" (``--nproc-per-node 1 --nnodes WORLD_SIZE
--node-rank RANK``) coordinated through one TCPStore, while the trainers see the real layout
(``--trainer-layout LOCAL_RANK,LOCAL_WORLD_SIZE,NODE_RANK``): Lightning's ``devices x
num_nodes`` arithmetic and ``LetoEnvironment``'s checks hold. The agents agree on one
retained-memory job id, so tier-2 parity spans a machine's ranks as under ``leto launch``;
after a failure the agent of local rank 0 repairs every store of its machine.

The store:

- torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, its default): torchrun's own agent store at
  ``MASTER_ADDR:MASTER_PORT``, reached as a client, keys under ``leto/<run id>/<restart
  count>``. It lives in torchrun's agent process, so no rank must outlive the others for it.
- torchrun without a shared agent store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): torchrun
  chose a free port on rank 0's host for worker rank 0 to host a store, so rank 0's agent hosts
  the Leto store there (no trainer opens one: the process group lives in the Leto store).
- srun: rank 0's agent hosts it at the address and port Lightning's ``SLURMEnvironment``
  derives (``MASTER_ADDR``/``MASTER_PORT`` if set, else the first host of ``SLURM_NODELIST`` and
  15000 + the last four digits of ``SLURM_JOB_ID``); Lightning would host its own store there.

The run directory (events, outputs): ``$LETO_RUN_DIR`` if set, else ``leto-runs/torchrun-<run
id>-<MASTER_PORT>[-restart<n>]`` or ``leto-runs/slurm-<job id>[.<step id>]``, the same for
every rank. Rank 0's agent writes the job's ``events.jsonl`` there; the agent of rank r > 0
writes ``agents/rank<r>/events.jsonl``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from .strategy import LetoStrategy


@dataclass(frozen=True)
class RankLaunch:
    """Where one externally launched process sits in the job, and how its agent reaches the others."""

    launcher: str  # "torchrun" or "srun"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    external_store: bool
    store_prefix: str
    run_dir: str


def detect(strategy: "LetoStrategy", env: Mapping[str, str] = os.environ) -> RankLaunch | None:
    """The rank this process is, when torchrun or srun started it (``None`` otherwise)."""
    if env.get("TORCHELASTIC_RUN_ID"):
        return from_torchrun(env)
    from lightning.fabric.plugins.environments import SLURMEnvironment

    cluster = strategy.cluster_environment
    if isinstance(cluster, SLURMEnvironment):
        return from_slurm(cluster, strategy.num_processes, env)
    return None


def from_torchrun(env: Mapping[str, str]) -> RankLaunch:
    run_id, port = env["TORCHELASTIC_RUN_ID"], env["MASTER_PORT"]
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    default_dir = os.path.join("leto-runs", f"torchrun-{run_id}-{port}" + (f"-restart{restart}" if restart else ""))
    return RankLaunch(
        "torchrun", rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]), node_rank=int(env["GROUP_RANK"]),
        master_addr=env["MASTER_ADDR"], master_port=int(port), external_store=shared,
        store_prefix=f"leto/{run_id}/{restart}" if shared else "", run_dir=env.get("LETO_RUN_DIR") or default_dir)


def from_slurm(cluster, devices: int, env: Mapping[str, str]) -> RankLaunch:
    """Ranks from srun's variables (through Lightning's ``SLURMEnvironment``); ``devices`` is the
    number of tasks per node Lightning assumes."""
    step = env.get("SLURM_STEP_ID")
    default_dir = os.path.join("leto-runs", f"slurm-{env.get('SLURM_JOB_ID', 'nojob')}" + (f".{step}" if step else ""))
    return RankLaunch(
        "srun", rank=cluster.global_rank(), world_size=cluster.world_size(), local_rank=cluster.local_rank(),
        local_world_size=devices, node_rank=cluster.node_rank(), master_addr=cluster.main_address,
        master_port=cluster.main_port, external_store=False, store_prefix="",
        run_dir=env.get("LETO_RUN_DIR") or default_dir)


def check_layout(launch: RankLaunch, devices: int, num_nodes: int) -> None:
    """The launcher's layout must be the Trainer's: ``devices`` ranks on each of ``num_nodes`` nodes,
    numbered node by node."""
    per_node = "--nproc-per-node" if launch.launcher == "torchrun" else "--ntasks-per-node"
    nodes = "--nnodes" if launch.launcher == "torchrun" else "--nodes"
    if launch.world_size != devices * num_nodes or launch.local_world_size != devices:
        raise RuntimeError(
            f"{launch.launcher} started {launch.world_size} ranks, {launch.local_world_size} per node, but the Trainer "
            f"asks for devices={devices} x num_nodes={num_nodes}: make Trainer(devices=...) equal to {per_node} and "
            f"Trainer(num_nodes=...) equal to {nodes}")
    if launch.rank != launch.node_rank * devices + launch.local_rank:
        raise RuntimeError(
            f"{launch.launcher} made rank {launch.rank} local rank {launch.local_rank} on node {launch.node_rank}: "
            f"LetoStrategy needs ranks numbered node by node (rank = node x {devices} + local rank)"
            + (": use srun --distribution=block" if launch.launcher == "srun" else ""))


def agent_argv(launch: RankLaunch, strategy: "LetoStrategy", script: str, args: list[str]) -> list[str]:
    """``python -m leto_lightning.cli launch ...`` supervising this one rank."""
    options = strategy.leto_options
    argv = ["-m", "leto_lightning.cli", "launch", "--nproc-per-node", "1", "--nnodes", str(launch.world_size),
            "--node-rank", str(launch.rank), "--master-addr", launch.master_addr,
            "--master-port", str(launch.master_port), "--run-dir", launch.run_dir,
            "--trainer-layout", f"{launch.local_rank},{launch.local_world_size},{launch.node_rank}",
            "--shadow-level", str(options.shadow_level), "--heartbeat-timeout", str(options.heartbeat_timeout)]
    if launch.external_store:
        argv += ["--external-store", "--store-prefix", launch.store_prefix]
    return [*argv, script, *args]


def become_rank_agent(strategy: "LetoStrategy", launch: RankLaunch, script: str | None) -> None:
    """Exec into this rank's agent (never returns), or raise saying what to do instead."""
    check_layout(launch, strategy.num_processes, strategy.num_nodes)
    how = "torchrun ... train.py" if launch.launcher == "torchrun" else "srun python train.py"
    if script is None:
        raise RuntimeError(
            f"LetoStrategy under {launch.launcher}: each rank's process becomes that rank's Leto agent, which re-runs "
            f"the script file -- start it as `{how}` (not with -m, -c or --no-python), or use `leto launch`")
    if os.environ.get("LETO_NO_SUPERVISE") == "1":
        raise RuntimeError(
            f"LetoStrategy under {launch.launcher} with LETO_NO_SUPERVISE=1: {launch.launcher} stops every rank when "
            "one fails, which is the failure Leto recovers from in place; unset LETO_NO_SUPERVISE (each rank then "
            "becomes its own Leto agent) or start the script with `leto launch`")
    argv = agent_argv(launch, strategy, script, sys.argv[1:])
    if launch.rank == 0:
        print(f"[leto] LetoStrategy under {launch.launcher}: each rank becomes its own supervisor (`leto launch "
              f"--nproc-per-node 1 --nnodes {launch.world_size} ...`, run dir {launch.run_dir})", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])
