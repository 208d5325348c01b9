"""Hardware profiles: what one accelerator (and its links) can do.

Built in: ``a100``, ``h100``, ``h200`` (NVIDIA SXM parts in 8-GPU HGX/DGX nodes) and ``cpu``
(this project's 2-core CPU machines, for the tiny recipes). Any field can be overridden
(``--hw peak_tflops=400``). Every default cites its source next to it; ``docs/simulator.md``
repeats them in a table.

Bandwidths are per accelerator and per direction, in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from leto_lightning.sim.checks import fail, fraction, int_at_least, positive, require


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator type and the cluster fabric around it."""

    name: str
    peak_tflops: float          # dense BF16 (FP32 for the cpu profile) peak, TFLOP/s
    hbm_gb: float               # device memory, GB
    hbm_gbps: float             # device memory bandwidth, GB/s
    nvlink_gbps: float          # intra-node bandwidth per GPU, one direction, GB/s
    net_gbps: float             # inter-node (scale-out NIC) bandwidth per GPU, one direction
    pcie_gbps: float            # host <-> device, one direction, GB/s
    gpus_per_node: int
    gemm_efficiency: float      # best achievable fraction of peak for large GEMMs
    gemm_half_dim: float        # GEMM inner size at which efficiency halves (small-GEMM penalty)
    comm_efficiency: float      # achieved fraction of link bandwidth by collectives
    collective_latency_us: float  # fixed cost per collective call
    ckpt_gbps: float            # effective in-memory snapshot bandwidth per GPU (Gemini-style)
    storage_gbps: float         # aggregate persistent-storage bandwidth of the cluster
    op_overhead_us: float = 0.0  # host cost per framework op (forward or backward) that the
    #                              device cannot hide; 0 on GPUs (asynchronous launches)

    def __post_init__(self) -> None:
        require(bool(self.name), "hardware.name", self.name, "must be a non-empty string")
        for f in fields(self):
            if f.name in ("name", "gpus_per_node", "gemm_efficiency", "comm_efficiency",
                          "op_overhead_us"):
                continue
            positive(f"hardware.{f.name}", getattr(self, f.name))
        int_at_least("hardware.gpus_per_node", self.gpus_per_node, 1)
        fraction("hardware.gemm_efficiency", self.gemm_efficiency)
        fraction("hardware.comm_efficiency", self.comm_efficiency)
        require(self.gemm_efficiency > 0, "hardware.gemm_efficiency", self.gemm_efficiency,
                "must be > 0")
        require(self.op_overhead_us >= 0, "hardware.op_overhead_us", self.op_overhead_us,
                "must be >= 0")
        require(self.comm_efficiency > 0, "hardware.comm_efficiency", self.comm_efficiency,
                "must be > 0")

    def with_overrides(self, overrides: Mapping[str, object]) -> HardwareProfile:
        """A copy with some fields replaced (validated like a new profile)."""
        known = {f.name: f.type for f in fields(self)}
        values: dict[str, object] = {}
        for key, raw in overrides.items():
            if key not in known or key == "name":
                fail("hardware override", key,
                     f"is not a hardware field (known: {', '.join(sorted(known))})")
            try:
                values[key] = int(raw) if key == "gpus_per_node" else float(raw)  # type: ignore[call-overload,arg-type]
            except (TypeError, ValueError):
                fail(f"hardware.{key}", raw, "is not a number")
        return replace(self, **values)  # type: ignore[arg-type]


# Calibration of the A100 in-memory checkpoint bandwidth: the paper's Table 4 tunes the Gemini
# interval to 11 / 19 / 27 iterations at MTTF 10 / 30 / 60 min for Kimi-MoE (9.1 s iterations).
# Young's formula I*T = sqrt(2*c*MTTF) gives the same snapshot cost c = 8.3 s at all three MTTFs;
# Kimi-MoE's optimizer state is 9.1 GB per GPU in this model (12 B/param, see systems.py), so
# 9.1 GB / 8.3 s = 1.1 GB/s per GPU. H100/H200 nodes have twice the NIC bandwidth per GPU
# (400 vs 200 Gb/s), so their snapshot bandwidth is scaled by 2 (assumption).
_A100_CKPT_GBPS = 1.1

# Llama 3 (arXiv:2407.21783, section 3.3.1): Tectonic serves checkpoints at 2 TB/s sustained
# (7 TB/s peak) to a 16K-GPU cluster. Used as the aggregate storage bandwidth of every profile.
_STORAGE_GBPS = 2000.0

BUILTIN_HARDWARE: dict[str, HardwareProfile] = {
    # NVIDIA A100 80GB SXM4 datasheet: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e, NVLink3 600 GB/s
    # total (300 per direction), PCIe Gen4 x16 (32 GB/s per direction); DGX A100: eight 200 Gb/s
    # HDR NICs, one per GPU (25 GB/s).
    "a100": HardwareProfile(
        name="a100", peak_tflops=312.0, hbm_gb=80.0, hbm_gbps=2039.0, nvlink_gbps=300.0,
        net_gbps=25.0, pcie_gbps=32.0, gpus_per_node=8,
        gemm_efficiency=0.70,   # assumption: large BF16 GEMMs reach ~70% of peak (cuBLAS)
        gemm_half_dim=64.0,     # assumption: a 64-wide GEMM dimension halves the efficiency
        comm_efficiency=0.80,   # assumption: NCCL bus bandwidth ~80% of link rate
        collective_latency_us=20.0,  # assumption: per-call launch + sync cost
        ckpt_gbps=_A100_CKPT_GBPS, storage_gbps=_STORAGE_GBPS),
    # NVIDIA H100 SXM5 80GB datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, NVLink4 900 GB/s
    # total, PCIe Gen5 x16 (64 GB/s per direction); DGX H100: eight 400 Gb/s NDR NICs (50 GB/s).
    "h100": HardwareProfile(
        name="h100", peak_tflops=989.0, hbm_gb=80.0, hbm_gbps=3350.0, nvlink_gbps=450.0,
        net_gbps=50.0, pcie_gbps=64.0, gpus_per_node=8, gemm_efficiency=0.70,
        gemm_half_dim=96.0,     # assumption: bigger tensor cores need bigger tiles than A100
        comm_efficiency=0.80, collective_latency_us=20.0,
        ckpt_gbps=2 * _A100_CKPT_GBPS, storage_gbps=_STORAGE_GBPS),
    # NVIDIA H200 SXM datasheet: same compute as H100, 141 GB HBM3e at 4.8 TB/s; DGX H200: eight
    # 400 Gb/s NICs.
    "h200": HardwareProfile(
        name="h200", peak_tflops=989.0, hbm_gb=141.0, hbm_gbps=4800.0, nvlink_gbps=450.0,
        net_gbps=50.0, pcie_gbps=64.0, gpus_per_node=8, gemm_efficiency=0.70,
        gemm_half_dim=96.0, comm_efficiency=0.80, collective_latency_us=20.0,
        ckpt_gbps=2 * _A100_CKPT_GBPS, storage_gbps=_STORAGE_GBPS),
    # This project's CPU machines (2 cores, Xeon with AVX-512, 23 GB RAM); a "device" is one
    # rank on one core (the tiny recipes run dp=2 on the 2 cores). Measured on this machine with
    # torch 2.13, one thread: FP32 matmul 158 GFLOP/s at 1024^3 and 134-146 GFLOP/s with a
    # 64-wide dimension (-> efficiency 0.95, half-width 8); out-of-place elementwise on 2-8 MB
    # tensors (activation sizes of the tiny recipes) 15-26 GB/s -> 20; 12.9 us per small
    # autograd op (forward and backward averaged). Links (gloo over shared memory) are
    # assumptions.
    "cpu": HardwareProfile(
        name="cpu", peak_tflops=0.158, hbm_gb=11.5, hbm_gbps=20.0, nvlink_gbps=2.0,
        net_gbps=1.0, pcie_gbps=10.0, gpus_per_node=2, gemm_efficiency=0.95,
        gemm_half_dim=8.0, comm_efficiency=0.5, collective_latency_us=100.0,
        ckpt_gbps=2.0, storage_gbps=0.5, op_overhead_us=12.9),
}


def get_hardware(name: str, overrides: Mapping[str, object] | None = None) -> HardwareProfile:
    """A built-in profile by name (case-insensitive), with optional field overrides."""
    key = str(name).lower()
    if key not in BUILTIN_HARDWARE:
        fail("hardware", name, f"is not a known profile (known: {', '.join(BUILTIN_HARDWARE)})")
    profile = BUILTIN_HARDWARE[key]
    return profile.with_overrides(overrides) if overrides else profile


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """``["peak_tflops=400", "net_gbps=50"]`` -> ``{"peak_tflops": "400", ...}``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        require(bool(sep) and bool(key.strip()) and bool(value.strip()), "--hw", item,
                "must look like field=value")
        out[key.strip()] = value.strip()
    return out
