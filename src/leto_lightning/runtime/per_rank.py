"""torchrun, ``accelerate launch`` and srun: every process they start becomes its rank's agent.

These launchers stop every rank when one of their processes dies -- the failure Leto recovers
from in place. So the process a launcher starts for a rank never trains: when the trainer
object is built (``Trainer(strategy="leto")``, ``LetoAccelerator(...)``), it ``exec``s itself
into ``leto launch`` supervising that one rank. The pid stays, so the launcher sees its worker
alive; the agent's exit status becomes the worker's. The agent runs the rank's active and
shadow trainers as its children and recovers them; the launcher never sees a rank die.

The Leto job then has WORLD_SIZE one-rank "nodes" (``--nproc-per-node 1 --nnodes WORLD_SIZE
--node-rank RANK``) coordinated through one TCPStore, while the trainers see the real layout
(``--trainer-layout LOCAL_RANK,LOCAL_WORLD_SIZE,NODE_RANK``). The agents agree on one
retained-memory job id, so tier-2 parity spans a machine's ranks as under ``leto launch``;
after a failure the agent of local rank 0 repairs every store of its machine.

The store:

- torchrun and ``accelerate launch`` (``TORCHELASTIC_USE_AGENT_STORE=True``, the default):
  torchrun's own agent store at ``MASTER_ADDR:MASTER_PORT``, reached as a client, keys under
  ``leto/<run id>/<restart count>``. It lives in the launcher's agent process, so no rank must
  outlive the others for it.
- without a shared agent store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): torchrun chose a free
  port on rank 0's host for worker rank 0 to host a store, so rank 0's agent hosts the Leto
  store there.
- srun: rank 0's agent hosts it at the address and port the integration derives (Lightning's
  ``SLURMEnvironment`` rule).

``accelerate launch`` always uses ``rdzv_backend=static`` and the run id ``none``: two jobs on
one port, one after the other, would share the derived run directory. Its workers therefore
agree on a job tag through the launcher's store (first writer wins; every job has a new store)
and use ``leto/none-<tag>/<restart>`` and ``leto-runs/accelerate-<tag>-<port>``.

The run directory (events, outputs): ``$LETO_RUN_DIR`` if set, else ``leto-runs/torchrun-<run
id>-<MASTER_PORT>[-restart<n>]``, ``leto-runs/accelerate-<tag>-<MASTER_PORT>`` or
``leto-runs/slurm-<job id>[.<step id>]``, the same for every rank. Rank 0's agent writes the
job's ``events.jsonl`` there; the agent of rank r > 0 writes ``agents/rank<r>/events.jsonl``.

Neutral: nothing here knows Lightning or Accelerate; each integration passes what it is
(``who``), the command that starts it right (``how``) and its runtime options.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

from ..console import notice
from ..env import FAULTS, NO_SUPERVISE, RUN_DIR, SHADOWS, WARM_TEMPLATE
from ..errors import UsageError

log = logging.getLogger(__name__)

ACCELERATE_MARKERS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")  # set by `accelerate launch`
_TAG_KEY = "leto/none/job_tag"


@dataclass(frozen=True)
class RankLaunch:
    """Where one externally launched process sits in the job, and how its agent reaches the others."""

    launcher: str  # "torchrun", "accelerate" or "srun"
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


def launched_by_accelerate(env: Mapping[str, str] = os.environ) -> bool:
    """True in a worker that ``accelerate launch`` started (through torchrun's elastic agent)."""
    return bool(env.get("TORCHELASTIC_RUN_ID")) and any(k in env for k in ACCELERATE_MARKERS)


def from_torchrun(env: Mapping[str, str] = os.environ) -> RankLaunch:
    """The rank of a torchrun (or ``accelerate launch``) worker, from its environment."""
    run_id, port = env["TORCHELASTIC_RUN_ID"], env["MASTER_PORT"]
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    launcher = "accelerate" if launched_by_accelerate(env) else "torchrun"
    default_dir = os.path.join("leto-runs", f"{launcher}-{run_id}-{port}" + (f"-restart{restart}" if restart else ""))
    return RankLaunch(
        launcher, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]), node_rank=int(env["GROUP_RANK"]),
        master_addr=env["MASTER_ADDR"], master_port=int(port), external_store=shared,
        store_prefix=f"leto/{run_id}/{restart}" if shared else "", run_dir=env.get(RUN_DIR) or default_dir)


def from_slurm(rank: int, world_size: int, local_rank: int, local_world_size: int, node_rank: int,
               master_addr: str, master_port: int, env: Mapping[str, str] = os.environ) -> RankLaunch:
    """An srun task; the integration derives the values (Lightning: its ``SLURMEnvironment``)."""
    step = env.get("SLURM_STEP_ID")
    default_dir = os.path.join("leto-runs", f"slurm-{env.get('SLURM_JOB_ID', 'nojob')}" + (f".{step}" if step else ""))
    return RankLaunch("srun", rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, node_rank=node_rank, master_addr=master_addr,
                      master_port=master_port, external_store=False, store_prefix="",
                      run_dir=env.get(RUN_DIR) or default_dir)


def with_job_tag(launch: RankLaunch, tag: str, env: Mapping[str, str] = os.environ) -> RankLaunch:
    """A run id of ``none`` made unique per job: ``none-<tag>`` in the store prefix and run dir."""
    restart = launch.store_prefix.rsplit("/", 1)[-1] if launch.store_prefix else "0"
    run_dir = env.get(RUN_DIR) or os.path.join(
        "leto-runs", f"{launch.launcher}-{tag}-{launch.master_port}" + (f"-restart{restart}" if restart != "0" else ""))
    prefix = f"leto/none-{tag}/{restart}" if launch.external_store else ""
    return replace(launch, store_prefix=prefix, run_dir=run_dir)


def agree_job_tag(launch: RankLaunch, timeout_s: float = 120.0) -> str:
    """One tag per job, the same on every rank: the first worker to reach the launcher's shared
    agent store sets it (every job starts a new store, so a later job gets a new tag)."""
    import torch.distributed as dist

    store = dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    try:
        mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        got = store.compare_set(_TAG_KEY, "", mine)
        return got.decode() if isinstance(got, bytes) else str(got)
    finally:
        del store  # closes the connection before exec


def resolve(launch: RankLaunch) -> RankLaunch:
    """Give a launch whose run id is ``none`` (``accelerate launch``, static rendezvous) a per-job
    tag; without a shared store to agree through, the job is told apart by its port only."""
    if launch.external_store and launch.store_prefix.startswith("leto/none/"):
        return with_job_tag(launch, agree_job_tag(launch))
    return launch


def check_layout(launch: RankLaunch, devices: int, num_nodes: int, who: str) -> None:
    """The launcher's layout must be the trainer's: ``devices`` ranks on each of ``num_nodes``
    nodes, numbered node by node."""
    per_node = "--ntasks-per-node" if launch.launcher == "srun" else "--nproc-per-node"
    nodes = "--nodes" if launch.launcher == "srun" else "--nnodes"
    if launch.world_size != devices * num_nodes or launch.local_world_size != devices:
        raise UsageError(
            f"{launch.launcher} started {launch.world_size} ranks, {launch.local_world_size} per node, but the Trainer "
            f"asks for devices={devices} x num_nodes={num_nodes}: make Trainer(devices=...) equal to {per_node} and "
            f"Trainer(num_nodes=...) equal to {nodes}")
    check_numbering(launch, who)


def check_numbering(launch: RankLaunch, who: str) -> None:
    """Ranks numbered node by node (rank = node x local world size + local rank)."""
    size = launch.local_world_size
    if launch.rank != launch.node_rank * size + launch.local_rank:
        raise UsageError(
            f"{launch.launcher} made rank {launch.rank} local rank {launch.local_rank} on node {launch.node_rank}: "
            f"{who} needs ranks numbered node by node (rank = node x {size} + local rank)"
            + (": use srun --distribution=block" if launch.launcher == "srun" else ""))


def agent_argv(launch: RankLaunch, shadow_level: int, heartbeat_timeout: float, script: str, args: list[str],
               env: Mapping[str, str] = os.environ) -> list[str]:
    """``python -m leto_lightning.cli launch ...`` supervising this one rank."""
    argv = ["-m", "leto_lightning.cli", "launch", "--nproc-per-node", "1", "--nnodes", str(launch.world_size),
            "--node-rank", str(launch.rank), "--master-addr", launch.master_addr,
            "--master-port", str(launch.master_port), "--run-dir", launch.run_dir,
            "--trainer-layout", f"{launch.local_rank},{launch.local_world_size},{launch.node_rank}",
            "--shadow-level", str(shadow_level), "--heartbeat-timeout", str(heartbeat_timeout)]
    if launch.external_store:
        argv += ["--external-store", "--store-prefix", launch.store_prefix]
    if env.get(FAULTS):  # injected faults (tests): the agent hands them to its trainers
        argv += ["--faults", env[FAULTS]]
    if env.get(WARM_TEMPLATE) == "0":  # trainers from a new interpreter each (as before the template)
        argv += ["--no-warm-template"]
    if env.get(SHADOWS) == "0":  # recover by starting new trainers
        argv += ["--no-shadows"]
    return [*argv, script, *args]


def start_command(launcher: str) -> str:
    """How to start a script file under ``launcher`` so each rank can become its agent."""
    return {"torchrun": "torchrun ... train.py", "srun": "srun python train.py",
            "accelerate": "accelerate launch --config_file configs/accelerate/leto.yaml train.py"}[launcher]


def check_script(launch: RankLaunch, script: str | None, who: str, env: Mapping[str, str] = os.environ) -> str:
    """The script file the agent re-runs; refuse (saying what to do) where there is none."""
    if script is None:
        flags = "-m or --no_python" if launch.launcher == "accelerate" else "-m, -c or --no-python"
        raise UsageError(
            f"{who} under {launch.launcher}: each rank's process becomes that rank's Leto agent, which re-runs the "
            f"script file -- start it as `{start_command(launch.launcher)}` (not with {flags}), or use `leto launch "
            f"--nproc-per-node {launch.local_world_size} train.py`")
    if env.get(NO_SUPERVISE) == "1":
        raise UsageError(
            f"{who} under {launch.launcher} with LETO_NO_SUPERVISE=1: {launch.launcher} stops every rank when one "
            "fails, which is the failure Leto recovers from in place; unset LETO_NO_SUPERVISE (each rank then "
            "becomes its own Leto agent) or start the script with `leto launch`")
    return script


def plain_script() -> str | None:
    """The script path when this process runs ``python script.py`` (not ``-m``, ``-c``, a REPL or
    a console script): only then can it be re-run under ``leto launch``."""
    main = sys.modules.get("__main__")
    path = sys.argv[0] if sys.argv else ""
    if getattr(main, "__spec__", None) is not None or not path.endswith(".py") or not os.path.isfile(path):
        return None
    return os.path.abspath(path)


def become_rank_agent(launch: RankLaunch, script: str | None, who: str, shadow_level: int,
                      heartbeat_timeout: float) -> None:
    """Exec into this rank's agent (never returns), or raise saying what to do instead."""
    script = check_script(launch, script, who)
    launch = resolve(launch)
    argv = agent_argv(launch, shadow_level, heartbeat_timeout, script, sys.argv[1:])
    if launch.rank == 0:
        notice(f"{who} under {launch.launcher}: each rank becomes its own supervisor (`leto launch "
               f"--nproc-per-node 1 --nnodes {launch.world_size} ...`, run dir {launch.run_dir})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])
