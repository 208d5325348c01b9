"""Start-up and recovery time terms, and how they grow with the number of GPUs.

Calibration anchors (the Leto paper's Table 3, copied in ``docs/sim/measured.json``: Kimi-MoE on 64 A100s):
Gemini's recovery initializes for 59 s, Gemini+ (a pre-warmed spare process) for 35 s and Leto
for 15 s. The split of those totals into the terms below is an assumption (the paper gives only
the totals); the terms that grow with cluster size come from public measurements:

- communicator initialization: stock NCCL bootstrap + connection setup takes ~265 s at 96K GPUs
  (Si et al., "Collective Communication for 100k+ GPUs" (NCCLX), arXiv:2510.20171, as summarized
  in its problem statement) -> 2.7 ms per rank; NCCLX's scalable initialization starts Llama 4
  jobs 11x faster (same paper) -> ``scalable`` mode divides the per-rank term by 11.
- rendezvous through a key-value store (TCPStore): a per-rank cost (assumption: 50 us per rank
  and operation; PyTorch moved to a libuv TCPStore backend for jobs of 1K to 96K ranks because
  the legacy one did not scale, see the "Introduction to Libuv TCPStore Backend" tutorial).

This project's own measurement (on its 2-core CPU machines): importing torch
and lightning takes ~5.2 s on the CPU machines and a 2-rank torchrun + Lightning job reaches its
first step 9.3-9.8 s after launch; GPU images import more, hence 10 s below.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from leto_lightning.sim.checks import non_negative, require

COMM_INIT_MODES = ("stock", "scalable")


@dataclass(frozen=True)
class StartupModel:
    """Seconds spent by the steps of a (re)start or an in-place recovery."""

    # -- every recovery ------------------------------------------------------------------------
    detect_s: float = 2.0          # assumption: agent sees the rank exit / exception report
    teardown_s: float = 3.0        # assumption: abort communicators, kill or stop every rank
    # -- steps a pre-warmed process already did (Table 3: 59 s - 35 s = 24 s) ------------------
    launch_s: float = 4.0          # assumption: scheduler relaunch of the rank processes
    import_s: float = 10.0         # 5.2 s measured on CPU (notes); GPU images larger (assumed)
    cuda_context_s: float = 4.0    # assumption: CUDA context + allocator warm-up
    model_build_s: float = 6.0     # assumption: build the model skeleton
    # -- steps every restart repeats (calibrated: Gemini+ init = 35 s at 64 GPUs, Table 3) -----
    runtime_setup_s: float = 26.5  # framework/DDP/optimizer setup, data loaders, first-step
    #                                connection setup: the remainder of Table 3's 35 s
    comm_init_base_s: float = 2.0  # assumption: communicator init floor at small scale
    comm_init_per_rank_s: float = 2.7e-3   # NCCLX paper: ~265 s at 96K GPUs with stock NCCL
    scalable_speedup: float = 11.0         # NCCLX paper: 11x faster start-up
    store_per_rank_s: float = 50e-6        # assumption: TCPStore cost per rank and operation
    # -- Leto's in-place recovery (sum with detect_s = Table 3's 15 s; split assumed) -----------
    leto_stop_s: float = 3.0       # stop survivors (NCCL abort), kill dead trainers
    leto_promote_s: float = 4.0    # attach retained state, rebind views, restore loop/RNG/data
    leto_repair_s: float = 1.0     # verify page checksums, RMU roll-forward, tier-1 repair
    leto_agree_s: float = 1.0      # agree on the resume iteration (flag all-reduce)
    leto_first_step_s: float = 4.0  # first step on the promoted shadows' communicators
    # -- warm-up after a cold restart -----------------------------------------------------------
    cold_warmup_iters: float = 1.65  # Table 3: Gemini recomputes 68 s vs Gemini+ 53 s at the
    #                                  same interval: 15 s = 1.65 iterations of 9.1 s
    comm_init: str = "stock"       # "stock" NCCL or "scalable" (NCCLX-class) initialization

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "comm_init":
                non_negative(f"startup.{f.name}", getattr(self, f.name))
        require(self.scalable_speedup >= 1, "startup.scalable_speedup", self.scalable_speedup,
                "must be >= 1")
        require(self.comm_init in COMM_INIT_MODES, "comm_init", self.comm_init,
                f"must be one of {', '.join(COMM_INIT_MODES)}")

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    # -- terms that grow with the cluster ------------------------------------------------------
    def comm_init_s(self, n_gpus: int) -> float:
        """Create every communicator of a job of ``n_gpus`` ranks."""
        per_rank = self.comm_init_per_rank_s
        if self.comm_init == "scalable":
            per_rank /= self.scalable_speedup
        return self.comm_init_base_s + per_rank * n_gpus

    def rendezvous_s(self, n_ranks: int) -> float:
        """Every rank registers with the job's store."""
        return self.store_per_rank_s * n_ranks

    @property
    def prewarmable_s(self) -> float:
        """What a pre-warmed spare process has already done."""
        return self.launch_s + self.import_s + self.cuda_context_s + self.model_build_s

    # -- composite steps ------------------------------------------------------------------------
    def restart_init_s(self, n_gpus: int, prewarmed: bool) -> float:
        """Stop the job and start (or attach) processes, runtime and communicators again;
        excludes loading the checkpoint."""
        cold = 0.0 if prewarmed else self.prewarmable_s
        return (self.detect_s + self.teardown_s + cold + self.rendezvous_s(n_gpus)
                + self.comm_init_s(n_gpus) + self.runtime_setup_s)

    def leto_inplace_s(self, n_gpus: int, gpus_per_node: int) -> float:
        """Leto's recovery on surviving hardware with L3 shadows ready: nothing is started,
        only the per-node agents coordinate through the store (one key per node)."""
        agents = max(1, math.ceil(n_gpus / gpus_per_node))
        return (self.detect_s + self.leto_stop_s + self.leto_promote_s + self.leto_repair_s
                + self.leto_agree_s + self.leto_first_step_s + 2 * self.rendezvous_s(agents))

    def shadow_rebuild_s(self, n_gpus: int) -> float:
        """Background time to pre-initialize a fresh pool of L3 shadows after a promotion:
        process, runtime, communicators among the shadows, framework setup."""
        return (self.prewarmable_s + self.rendezvous_s(n_gpus) + self.comm_init_s(n_gpus)
                + self.runtime_setup_s)
