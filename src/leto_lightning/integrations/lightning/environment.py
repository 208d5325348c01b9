"""``LetoEnvironment``: the cluster environment of a rank that ``leto launch`` started.

Why not Lightning's ``LightningEnvironment``: it caches ``MASTER_PORT`` and would have
``_init_dist_connection`` create a TCPStore on it -- but under ``leto launch`` the agent
already listens there, and the process group must live under the session's generation-
(or shadow-set-) scoped prefix. ``LetoStrategy`` therefore never lets Lightning initialise
the process group in this environment (``runtime_link.RuntimeLink.init_process_group``);
this class only tells Lightning who this rank is, re-reading the environment every time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from typing_extensions import override

from ...env import NODE_RANK, under_launcher
from ...errors import ConfigurationError


def under_leto_launch(env: Mapping[str, str] = os.environ) -> bool:
    """True in a trainer process started by ``leto launch`` (active or shadow)."""
    return under_launcher(env)


class LetoEnvironment(ClusterEnvironment):
    """Ranks started by ``leto launch`` (never by Lightning): values come from the environment."""

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])  # re-read: never cached across generations

    @staticmethod
    @override
    def detect() -> bool:
        return under_leto_launch()

    @override
    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    @override
    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            raise ConfigurationError(
                f"the Trainer asks for {size} ranks (devices x num_nodes), but `leto launch` started WORLD_SIZE="
                f"{self.world_size()}: make Trainer(devices=...) equal to --nproc-per-node "
                f"({os.environ.get('LOCAL_WORLD_SIZE', '?')}) and Trainer(num_nodes=...) equal to --nnodes")

    @override
    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    @override
    def set_global_rank(self, rank: int) -> None:
        if rank != self.global_rank():
            raise ConfigurationError(f"Lightning computed global rank {rank}, `leto launch` assigned "
                                     f"RANK={self.global_rank()}: Trainer(devices=...) must equal --nproc-per-node")

    @override
    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    @override
    def node_rank(self) -> int:
        return int(os.environ.get(NODE_RANK, os.environ.get("GROUP_RANK", "0")))

    @override
    def teardown(self) -> None:
        """Nothing to undo: the environment belongs to ``leto launch``."""
