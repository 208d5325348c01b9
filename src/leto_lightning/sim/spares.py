"""Hot spare nodes for non-HOFs (the ``leto+spares`` system): the pool, the state a spare must
receive, and the cross-node erasure-coded tier (tier 3) that protects state no replica holds.

A non-HOF loses a node (its GPUs, host memory and retained state). With a spare in the pool the
lost node's ranks move to the spare, which is pre-warmed (processes launched, runtime and model
built) and joins the promoted shadows' communicators; it receives the lost ranks' state over
the network while the other nodes recover in place exactly as after a HOF. The job continues
at the interrupted iteration. The used spare leaves the pool; the lost node comes back to it
after a repair time. A non-HOF that finds the pool empty takes Leto's checkpoint path.

Model (per GPU; ``docs/simulator.md`` section 1.8):

- **State the spare receives**: BF16 weights and the FP32 optimizer shard (master weights and
  Adam moments) of each lost rank; gradients are recomputed with the interrupted iteration.
  A part is *replicated* when another node holds a copy: dense weights across DP, expert
  weights across expert-DP (``dp*tp/ep``), and the optimizer state too when the optimizer is
  not sharded. The DP (expert-DP) group must leave the node (``dp*tp > gpus_per_node``);
  a copy on the lost node is lost with it. With a sharded optimizer each shard exists once.
- **Copy** from a replica: ``replicated / B`` with ``B = net_gbps * comm_efficiency`` per GPU
  (every GPU of the spare receives its rank's part on its own NIC: per-node bytes over the
  node's ``gpus_per_node * net_gbps``).
- **Tier 3** (unreplicated state only): a systematic code over ``k`` data GPUs on ``k``
  different nodes with ``m`` parity blocks held in host memory on other nodes (``k`` is cut to
  ``nodes - m`` on smaller jobs; a one-node job has no tier 3). Rebuilding a
  lost GPU's state reads ``k`` pages per lost page: ``k * unreplicated / B``. Each iteration
  sends every GPU's parity delta (``new ^ old``, already computed for tier 1) to its ``m``
  parity holders: ``m * unreplicated / B * (1 - tier3_overlap)`` added to the iteration, and
  ``m / k * unreplicated`` bytes of host memory per GPU. No tier 3 where nothing is unreplicated.
- **Pool**: K spare nodes, non-HOFs arrive as Poisson(``(1 - hof_ratio) / MTTF``), each takes
  a spare for ``repair_s``. A non-HOF finds the pool empty with the Erlang loss probability
  ``B(K, a)``, ``a = rate * repair_s`` (exact for Poisson arrivals and any repair-time
  distribution; the Monte Carlo replays the pool with a fixed repair time, failure by failure).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from leto_lightning.sim.checks import fail, fraction, int_at_least, non_negative, positive, require
from leto_lightning.sim.hardware import HardwareProfile
from leto_lightning.sim.iteration import BF16, OPTIMIZER_STATE_BYTES, gpu_share
from leto_lightning.sim.workload import Workload

TIER3_MODES = ("auto", "on", "off")
DEFAULT_SHARE = 0.02          # assumption: 2% of the job's nodes kept as hot spares
DEFAULT_REPAIR_S = 24 * 3600.0  # assumption: a lost node is back in the pool after 24 h
DEFAULT_JOIN_S = 2.0          # assumption: the spare joins the shadows' communicators (grow)


@dataclass(frozen=True)
class SpareConfig:
    """The hot spare pool and tier 3 of ``leto+spares`` (``--spares``, ``--spare-repair``,
    ``--spare-join``, ``--tier3``)."""

    nodes: int | None = None         # spare nodes; None: ``share`` of the job's nodes, rounded up
    share: float = DEFAULT_SHARE     # used when ``nodes`` is None
    repair_s: float = DEFAULT_REPAIR_S   # a used spare's node returns to the pool after this
    join_s: float = DEFAULT_JOIN_S   # the spare's ranks join the promoted shadows' communicators
    tier3: str = "auto"              # auto: the evaluator keeps tier 3 only where it raises ETTR
    tier3_k: int = 8                 # data blocks per tier-3 stripe (each on its own node)
    tier3_m: int = 1                 # parity blocks per stripe (node losses a stripe survives)
    tier3_overlap: float = 0.0       # share of the per-iteration parity traffic hidden

    def __post_init__(self) -> None:
        if self.nodes is not None:
            int_at_least("--spares", self.nodes, 0)
        number = isinstance(self.share, (int, float)) and not isinstance(self.share, bool)
        require(number and 0.0 <= self.share <= 1.0, "--spares",
                f"{100 * self.share:g}%" if number else self.share,
                "must be a share of the job's nodes in [0%, 100%] (e.g. 2%) or a node count")
        positive("--spare-repair", self.repair_s)
        non_negative("--spare-join", self.join_s)
        require(self.tier3 in TIER3_MODES, "--tier3", self.tier3,
                f"must be one of {', '.join(TIER3_MODES)}")
        int_at_least("spares.tier3_k", self.tier3_k, 1)
        int_at_least("spares.tier3_m", self.tier3_m, 1)
        fraction("spares.tier3_overlap", self.tier3_overlap)

    def pool_nodes(self, job_nodes: int) -> int:
        """Spare nodes for a job of ``job_nodes`` nodes."""
        if self.nodes is not None:
            return self.nodes
        return math.ceil(self.share * job_nodes - 1e-9)


def erlang_b(servers: int, offered: float) -> float:
    """Erlang's loss probability: all ``servers`` busy, Poisson arrivals of ``offered`` load
    (arrival rate x mean holding time). ``B(0, a) = 1``; ``B(K, 0) = 0`` for K > 0."""
    int_at_least("servers", servers, 0)
    non_negative("offered load", offered)
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return blocking


def _remote_replica(hw: HardwareProfile, size: int, stride: int) -> bool:
    """Whether a group of ``size`` replicas spaced ``stride`` ranks apart reaches another node
    (Megatron rank order: tp fastest, then dp)."""
    in_node = max(1, min(size, hw.gpus_per_node // max(stride, 1)))
    return size > in_node


@dataclass(frozen=True)
class StateSplit:
    """Bytes of one GPU's state a spare needs, by whether another node holds a copy."""

    replicated: float
    unreplicated: float


def state_split(workload: Workload, hw: HardwareProfile) -> StateSplit:
    """BF16 weights + optimizer shard of one GPU, split by replication off the node."""
    p, share = workload.parallel, gpu_share(workload)
    replicated = unreplicated = 0.0
    for weights, shard, size, stride in ((share.dense, share.dense_shard, p.dp, p.tp),
                                         (share.expert, share.expert_shard, p.edp, p.ep)):
        remote = _remote_replica(hw, size, stride)
        optimizer = shard * OPTIMIZER_STATE_BYTES
        optimizer_copied = remote and not p.sharded_optimizer
        replicated += (weights * BF16 if remote else 0.0) + (optimizer if optimizer_copied else 0.0)
        unreplicated += (0.0 if remote else weights * BF16) + (0.0 if optimizer_copied else optimizer)
    return StateSplit(replicated, unreplicated)


@dataclass(frozen=True)
class SparePlan:
    """What ``leto+spares`` does for one workload, hardware, failure rate and configuration."""

    nodes: int                 # spare nodes in the pool
    job_nodes: int
    gpus_per_node: int
    repair_s: float
    nonhof_rate_per_s: float
    offered: float             # spares in repair on average if none were ever missing
    blocking: float            # probability that a non-HOF finds the pool empty
    replicated_gb: float       # per GPU, copied from a replica
    unreplicated_gb: float     # per GPU, rebuilt from tier 3 (or lost without it)
    stripe_k: int              # tier-3 data blocks per stripe on this job (0: too few nodes)
    tier3: bool
    join_s: float
    copy_s: float
    rebuild_s: float
    encode_s: float            # added to every iteration (tier 3 on)
    parity_host_gb: float      # tier-3 parity per GPU, host memory

    @property
    def usable(self) -> bool:
        """A spare can take a lost node: the pool is not empty by construction and every byte
        of the lost state has a replica or tier-3 parity."""
        return self.nodes > 0 and (self.unreplicated_gb == 0 or self.tier3)

    @property
    def transfer_s(self) -> float:
        return self.copy_s + self.rebuild_s

    @property
    def idle_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "usable": self.usable, "transfer_s": self.transfer_s,
                "idle_gpus": self.idle_gpus}

    def describe(self) -> list[str]:
        """Two lines for ``leto simulate``'s header."""
        pool = (f"{self.nodes:,} hot spare nodes ({self.idle_gpus:,} GPUs idle, "
                f"{100 * self.nodes / self.job_nodes:.2g}% of {self.job_nodes:,} nodes), repair "
                f"{self.repair_s / 3600:g} h: {self.offered:.3g} in repair on average, a non-HOF "
                f"finds none free with p={self.blocking:.3g}")
        if not self.usable:
            why = ("the pool is empty" if self.nodes == 0 else
                   f"{self.unreplicated_gb:.3g} GB per GPU has no replica and tier 3 is off"
                   if self.stripe_k else "too few nodes for a tier-3 stripe")
            return [pool, f"no spare recovery: {why}; every non-HOF takes Leto's path"]
        tier3 = (f" + tier-3 rebuild {self.unreplicated_gb:.3g} GB/GPU x k={self.stripe_k} in "
                 f"{self.rebuild_s:.3g} s; tier 3 costs {1e3 * self.encode_s:.3g} ms per "
                 f"iteration and {self.parity_host_gb:.3g} GB host parity per GPU"
                 if self.tier3 else ", tier 3 off")
        return [pool, f"spare recovery: join {self.join_s:g} s + copy {self.replicated_gb:.3g} "
                      f"GB/GPU from replicas in {self.copy_s:.3g} s{tier3}"]

    def found_spare(self, times: np.ndarray, nonhof: np.ndarray) -> np.ndarray:
        """Replay the pool over failure ``times`` (runs x m, +inf past the horizon): True where
        a non-HOF found a spare. A used spare is back ``repair_s`` later (fixed)."""
        found = np.zeros(times.shape, dtype=bool)
        if self.nodes == 0:
            return found
        back = np.zeros((times.shape[0], self.nodes))   # when each spare is (again) free
        rows = np.arange(times.shape[0])
        for k in range(times.shape[1]):
            t = times[:, k]
            first = np.argmin(back, axis=1)
            ok = nonhof[:, k] & np.isfinite(t) & (back[rows, first] <= t)
            back[rows[ok], first[ok]] = t[ok] + self.repair_s
            found[:, k] = ok
        return found


def plan(config: SpareConfig, workload: Workload, hw: HardwareProfile, nonhof_rate_per_s: float,
         tier3: bool | None = None) -> SparePlan:
    """The pool, transfer and tier-3 costs; ``tier3=None`` follows ``config.tier3`` ("auto":
    on where some state has no replica)."""
    non_negative("non-HOF rate", nonhof_rate_per_s)
    split = state_split(workload, hw)
    if tier3 is None:
        tier3 = config.tier3 == "on" or (config.tier3 == "auto" and split.unreplicated > 0)
    job_nodes = max(1, math.ceil(workload.n_gpus / hw.gpus_per_node))
    k, m = stripe_width(config, job_nodes), config.tier3_m
    tier3 = tier3 and split.unreplicated > 0 and k > 0
    nodes = config.pool_nodes(job_nodes)
    bandwidth = hw.net_gbps * hw.comm_efficiency * 1e9
    offered = nonhof_rate_per_s * config.repair_s
    return SparePlan(
        nodes=nodes, job_nodes=job_nodes, gpus_per_node=hw.gpus_per_node, stripe_k=k,
        repair_s=config.repair_s, nonhof_rate_per_s=nonhof_rate_per_s, offered=offered,
        blocking=erlang_b(nodes, offered), replicated_gb=split.replicated / 1e9,
        unreplicated_gb=split.unreplicated / 1e9, tier3=tier3, join_s=config.join_s,
        copy_s=split.replicated / bandwidth,
        rebuild_s=k * split.unreplicated / bandwidth if tier3 else 0.0,
        encode_s=(m * split.unreplicated / bandwidth * (1 - config.tier3_overlap)) if tier3 else 0.0,
        parity_host_gb=m / k * split.unreplicated / 1e9 if tier3 else 0.0)


def stripe_width(config: SpareConfig, job_nodes: int) -> int:
    """Tier-3 data blocks per stripe: ``tier3_k``, fewer on a job with under ``k + m`` nodes
    (every block of a stripe on its own node); 0 when no stripe fits."""
    return max(0, min(config.tier3_k, job_nodes - config.tier3_m))


def tier3_choices(config: SpareConfig, workload: Workload, hw: HardwareProfile) -> tuple[bool, ...]:
    """Tier-3 settings the evaluator compares: both under "auto" when some state has no
    replica (off first, so a tie keeps it off), else the configured one."""
    job_nodes = max(1, math.ceil(workload.n_gpus / hw.gpus_per_node))
    needed = state_split(workload, hw).unreplicated > 0 and stripe_width(config, job_nodes) > 0
    if config.tier3 == "auto":
        return (False, True) if needed else (False,)
    return (config.tier3 == "on" and needed,)


def parse_spares(text: str) -> tuple[int | None, float]:
    """``--spares``: a node count (``16``) or a share of the job's nodes (``2%``), as the
    ``(nodes, share)`` fields of ``SpareConfig``."""
    raw = str(text).strip()
    number = raw[:-1].strip() if raw.endswith("%") else raw
    try:
        value = float(number)
    except ValueError:
        fail("--spares", text, "must be a node count (e.g. 16) or a share of the job's nodes "
                               "(e.g. 2%)")
    if raw.endswith("%"):
        return None, value / 100
    require(math.isfinite(value) and value == int(value), "--spares", text,
            "must be a whole number of nodes, or a share such as 2%")
    return int(value), DEFAULT_SHARE
