"""What one ``leto launch`` agent supervises: the job's layout and this node's place in it.

``LaunchSpec`` is validated when built (ranges) and by ``preflight`` (what the machine can
check: the script exists, the address resolves, the rank count fits); its derived properties
answer the questions every part of the agent asks (which ranks are mine, which stores do I
repair, which device does a rank use).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from dataclasses import dataclass, field

from ..errors import ConfigurationError
from .rundir import DEFAULT_MODE


@dataclass(frozen=True)
class LaunchSpec:
    script: str
    args: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_dir: str = "leto-runs/latest"
    faults: list[dict] = field(default_factory=list)
    python: str = sys.executable
    # Per-rank supervision (torchrun / srun workers that became their rank's agent): this agent is
    # one of ``nnodes`` one-rank "nodes" (``node_rank`` = the rank); its trainers see the real
    # layout (local rank, local world size, node rank) so that Lightning's rank arithmetic holds.
    trainer_layout: tuple[int, int, int] | None = None
    external_store: bool = False  # connect to a store hosted elsewhere (torchrun's agent store)
    store_prefix: str = ""  # namespace of the job's keys in that store
    run_dir_mode: int = DEFAULT_MODE  # the run dir's permissions; files get them without x bits
    secret_file: str | None = None  # the job's control-plane secret, the same on every node (runtime/auth.py)
    # Hot spares (runtime/membership.py): launch node ranks nnodes .. nnodes + spares - 1 are spare
    # agents that wait warm and take over a lost node's slot (its node rank) with its ranks' state.
    spares: int = 0

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigurationError(f"nproc_per_node={self.nproc_per_node} and nnodes={self.nnodes} must be >= 1")
        if self.spares < 0:
            raise ConfigurationError(f"--spares {self.spares}: the number of spare nodes is 0 or more")
        if not 0 <= self.node_rank < self.nnodes + self.spares:
            spare = f" + spares={self.spares}" if self.spares else ""
            raise ConfigurationError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes}{spare})")
        if self.spares:
            self._check_spares()
        if self.external_store and not self.master_port:
            raise ConfigurationError("an external store needs its --master-port")
        if not 0 <= self.master_port <= 65535:
            raise ConfigurationError(f"--master-port {self.master_port}: a TCP port is 1..65535 (0: pick a free one)")
        if self.trainer_layout is not None:
            self._check_layout(*self.trainer_layout)

    def _check_spares(self) -> None:
        if self.nnodes < 2:
            raise ConfigurationError(
                f"--spares {self.spares} with --nnodes {self.nnodes}: node 0 hosts the job's store and cannot be "
                "replaced, so spares need a job of at least 2 training nodes")
        if self.trainer_layout is not None or self.external_store:
            raise ConfigurationError(
                "--spares needs one `leto launch` agent per node hosting the job's store (not the per-rank agents "
                "under torchrun/srun or an external store): start `leto launch --nnodes N --spares K` on N + K nodes")

    @property
    def is_spare(self) -> bool:
        """A spare agent that holds no node slot (yet): it has no ranks to run."""
        return self.node_rank >= self.nnodes

    def taking_over(self, node: int) -> LaunchSpec:
        """The spec of a spare that took over ``node``'s slot: that node's ranks, repair duty and
        place in every lockstep step."""
        return dataclasses.replace(self, node_rank=node)

    def _check_layout(self, local_rank: int, local_world_size: int, node: int) -> None:
        if self.nproc_per_node != 1:
            raise ConfigurationError(f"--trainer-layout supervises one rank per agent: --nproc-per-node must be 1, "
                                     f"not {self.nproc_per_node}")
        if not 0 <= local_rank < local_world_size or node < 0:
            raise ConfigurationError(f"trainer layout (local rank {local_rank}, local world size {local_world_size}, "
                                     f"node {node}): need 0 <= local rank < local world size and node >= 0")
        if self.nnodes % local_world_size or node * local_world_size + local_rank != self.node_rank:
            raise ConfigurationError(
                f"rank {self.node_rank} of {self.nnodes} as local rank {local_rank} of {local_world_size} on node "
                f"{node}: ranks must be laid out node by node (rank = node x local world size + local rank), with "
                "the same number on every node")

    def preflight(self) -> None:
        """What can be checked before anything starts: a wrong value fails in a second with its
        name, instead of after a minute's hang or twenty restarts of a trainer that cannot start."""
        if not self.script.startswith("-") and not os.path.isfile(self.script):
            raise ConfigurationError(f"training script {self.script!r} not found: give the path of an existing file")
        try:
            socket.getaddrinfo(self.master_addr, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise ConfigurationError(f"--master-addr {self.master_addr!r} is not an address or host name this machine "
                                     f"can resolve ({exc}): give node 0's address, e.g. 127.0.0.1") from None
        cores, devices = len(os.sched_getaffinity(0)), _device_count()
        limit = max(devices, MAX_RANKS_PER_CORE * cores)
        if self.nproc_per_node > limit:
            raise ConfigurationError(
                f"--nproc-per-node {self.nproc_per_node}: far more ranks than this machine has ({cores} CPU cores, "
                f"{devices} GPUs; at most {limit}), each with a shadow trainer -- use one rank per GPU or core")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def local_ranks(self) -> list[int]:
        """The global ranks this agent's trainers run."""
        first = self.node_rank * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))

    @property
    def repair_ranks(self) -> list[int]:
        """The ranks whose stores this agent repairs: its node's. A per-rank agent (torchrun,
        srun) of local rank 0 repairs every store of its machine (tier-2 parity spans them);
        the other per-rank agents repair none and only take part in the agreement."""
        if self.trainer_layout is None:
            return self.local_ranks
        local_rank, local_world_size, _node = self.trainer_layout
        return [] if local_rank else list(range(self.node_rank, self.node_rank + local_world_size))

    def device_index(self, rank: int) -> int:
        """The local index (device) of a rank of this agent."""
        if self.trainer_layout is not None:
            return self.trainer_layout[0]
        return rank - self.node_rank * self.nproc_per_node

    @property
    def events_dir(self) -> str:
        """Per-rank agents share the run dir; the job's ``events.jsonl`` is rank 0's agent's."""
        if self.trainer_layout is None or self.node_rank == 0:
            return self.run_dir
        return os.path.join(self.run_dir, "agents", f"rank{self.node_rank}")


MAX_RANKS_PER_CORE = 4  # a CPU job beyond this many ranks (each with a shadow) per core is a typo


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
