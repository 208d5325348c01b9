"""The environment ``leto launch`` gives its trainers: torchrun's conventions, plus Leto's own.

Why it matters: the same script must compute the same numbers under ``leto launch`` as under
``torchrun``. The one variable that changes numerics is ``OMP_NUM_THREADS``: torchrun sets it to
1 for every worker when it is unset and more than one process runs per node (with a notice),
and a different intra-op thread count changes how reductions (LayerNorm's gradients, matmuls)
split their sums -- one ulp apart from the first step. Shadows get the same value as the
trainers they replace, so a promoted shadow computes what the trainer it replaces would have.

Every variable torchrun's local agent sets for a worker (``LocalElasticAgent._start_workers``)
and what ``leto launch`` does with it (docs/runtime.md, "Environment of the trainers"):

- ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``,
  ``MASTER_PORT``: the same meaning (one role, ``"default"``, as torchrun's default).
- ``OMP_NUM_THREADS``: the same rule and notice (``omp_defaults``).
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: the same default (1): a collective that fails aborts
  the process, which the agent then detects and recovers.
- ``CUDA_VISIBLE_DEVICES``: inherited, as torchrun does by default.
- ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
  ``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_ERROR_FILE``: deliberately *not* set. They
  say "a torchrun worker": Lightning would pick its TorchElastic environment, ``LetoStrategy``
  would make the process its rank's supervisor (``per_rank.py``), and ``env://`` with the agent
  store would join the agent's store outside the generation's namespace. The generation
  (``LETO_GENERATION``) is Leto's restart count. (Under torchrun with per-rank supervision the
  trainers inherit torchrun's values: ``LETO_ROLE`` tells them they are supervised.)
- torchrun runs ``python -u``: ``PYTHONUNBUFFERED=1`` here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# torchrun's own text (torch/distributed/run.py), so that a user sees the same notice
OMP_NOTICE = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be "
    "{threads} in default, to avoid your system being overloaded, "
    "please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************"
)
ROLE_NAME = "default"  # torchrun's --role default


def omp_defaults(nproc_per_node: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": "1"}`` where torchrun would set it (unset, more than one process
    per node), else nothing: an explicit value is always passed through unchanged."""
    if "OMP_NUM_THREADS" not in environ and nproc_per_node > 1:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def omp_notice(defaults: Mapping[str, str]) -> str | None:
    """torchrun's notice for the thread default, or None when nothing was set."""
    if "OMP_NUM_THREADS" not in defaults:
        return None
    return OMP_NOTICE.format(threads=defaults["OMP_NUM_THREADS"])


def torchrun_variables(rank: int, local_rank: int, world_size: int, local_world_size: int, group_rank: int,
                       master_addr: str, master_port: int,
                       environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables torchrun's agent sets per worker that ``leto launch`` sets the same way."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(max(1, world_size // max(1, local_world_size))),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": ROLE_NAME,
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "PYTHONUNBUFFERED": "1",
    }
