"""torchrun and srun under ``LetoStrategy``: every process they start becomes its rank's agent.

The mechanism (exec into ``leto launch`` supervising one rank, the store, the run directory,
tier 2) is launcher-neutral and lives in ``runtime/per_rank.py``, shared with the Accelerate
integration. What is Lightning's here: which srun rank a process is (Lightning's
``SLURMEnvironment`` derives it, and the address and port Lightning would host its own store
at: ``MASTER_ADDR``/``MASTER_PORT`` if set, else the first host of ``SLURM_NODELIST`` and 15000
+ the last four digits of ``SLURM_JOB_ID``), and the check that the launcher's layout is the
Trainer's ``devices x num_nodes``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment

from ...runtime import per_rank as neutral
from ...runtime.options import LetoRuntimeOptions
from ...runtime.per_rank import RankLaunch, agent_argv, check_layout, from_torchrun, plain_script  # noqa: F401

WHO = "LetoStrategy"


def detect(cluster: ClusterEnvironment | None, devices: int, env: Mapping[str, str] = os.environ) -> RankLaunch | None:
    """The rank this process is, when torchrun or srun started it (``None`` otherwise);
    ``cluster``/``devices``: the strategy's cluster environment and processes per node."""
    if env.get("TORCHELASTIC_RUN_ID"):
        return from_torchrun(env)
    if isinstance(cluster, SLURMEnvironment):
        return from_slurm(cluster, devices, env)
    return None


def from_slurm(cluster: SLURMEnvironment, devices: int, env: Mapping[str, str] = os.environ) -> RankLaunch:
    """Ranks from srun's variables (through Lightning's ``SLURMEnvironment``); ``devices`` is the
    number of tasks per node Lightning assumes."""
    return neutral.from_slurm(cluster.global_rank(), cluster.world_size(), cluster.local_rank(), devices,
                              cluster.node_rank(), cluster.main_address, cluster.main_port, env)


def become_rank_agent(launch: RankLaunch, script: str | None, devices: int, num_nodes: int,
                      options: LetoRuntimeOptions) -> None:
    """Exec into this rank's agent (never returns), or raise saying what to do instead;
    ``devices x num_nodes``: the Trainer's layout, which the launcher's must equal."""
    check_layout(launch, devices, num_nodes, WHO)
    neutral.become_rank_agent(launch, script, WHO, options.shadow_level, options.heartbeat_timeout)
