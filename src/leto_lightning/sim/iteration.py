"""Iteration time and memory of one training iteration, from workload and hardware.

The model (all per GPU, per iteration):

- **compute**: training FLOPs = 3 x forward FLOPs (forward + backward at twice the cost);
  forward FLOPs per token = 2 x (non-expert weights except the input embedding) + 2 x routed
  weights a token uses + causal attention scores (2 x seq_len x d_model per layer). Dense work
  is split over TP x PP of a replica; expert work is spread evenly over all GPUs (balanced
  routing). GEMM efficiency = ``gemm_efficiency * m / (m + gemm_half_dim)`` with ``m`` the
  smallest GEMM dimension (TP-split width for dense layers, tokens per expert for experts).
- **TP**: 8 x (tp-1)/tp x micro_batch x seq x d_model x 2 B per layer per micro-batch (the four
  all-gather/reduce-scatter pairs of Megatron sequence parallelism), over NVLink inside a node.
- **EP**: four all-to-alls per MoE layer per micro-batch (dispatch and combine, forward and
  backward), each sending (micro_batch x seq / tp) x top_k x d_model x 2 B x (ep-1)/ep per GPU,
  the inter-node share at NIC bandwidth.
- **DP**: gradient reduce-scatter (FP32 main grads) and parameter all-gather (BF16), or an
  all-reduce when the optimizer is not sharded, over DP for dense weights and over the expert
  data-parallel group (dp*tp/ep) for experts.
- **pipeline**: 1F1B bubble of (pp-1)/vpp micro-batch stage times, plus P2P activations.
- **elementwise**: norms, activations, residuals, softmax and MoE token permutation are memory
  bound: the activation bytes of a layer (the memory model below) are moved 3 times (written in
  the forward pass, read and rewritten in the backward pass) at 80% of HBM bandwidth.
- **optimizer**: AdamW step is memory bound: 30 B touched per optimizer-shard parameter.
- **op overhead**: host cost per framework op that the device cannot hide (the ``cpu``
  profile's measured dispatch cost; 0 on GPUs): forward ops per layer and micro-batch
  (estimated for this project's pure-torch model, which loops over local experts) x 2 for
  the backward pass, plus a fixed count per iteration (embedding, loss, clipping, optimizer).
- **overlap**: each communication is hidden behind compute by a fraction (``OverlapConfig``);
  DP can never hide more than the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from leto_lightning.sim.checks import fraction
from leto_lightning.sim.hardware import HardwareProfile
from leto_lightning.sim.workload import Workload

BF16 = 2
FP32 = 4
ADAM_BYTES_TOUCHED = 30   # read master+m+v+grad (16 B), write master+m+v (12 B), write BF16 (2 B)
OPTIMIZER_STATE_BYTES = 12  # FP32 master weights + Adam m and v, per parameter
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
# Table 2): 34*s*b*h/t bytes of activations per layer with sequence parallelism and selective
# recomputation.
ACT_BYTES_PER_SBH = 34
RUNTIME_RESERVED_GB = 3.0   # assumption: CUDA context, NCCL buffers, allocator slack
ELEMENTWISE_PASSES = 3      # assumption: activation bytes written (fwd), read + rewritten (bwd)
HBM_EFFICIENCY = 0.8        # assumption: memory-bound kernels reach 80% of HBM bandwidth
# Forward framework ops (estimates for leto_lightning.models.moe_transformer): a layer's two
# RMSNorms, attention with rotary embedding, residuals and a SwiGLU FFN; a router (softmax,
# top-k, load-balancing loss); per local expert: select tokens, SwiGLU, scale, scatter back.
OPS_PER_LAYER = 52
OPS_PER_ROUTER = 15
OPS_PER_EXPERT = 10
OPS_PER_ITERATION = 40


@dataclass(frozen=True)
class OverlapConfig:
    """Fraction of each communication hidden behind computation (0 = fully exposed)."""

    tp: float = 0.3   # assumption: Megatron --tp-comm-overlap hides part of the TP collectives
    ep: float = 0.5   # assumption: all-to-all overlapped with shared-expert/attention work
    #                   (DeepSeek-V3's DualPipe hides it entirely; plain Megatron hides little)
    dp: float = 0.9   # assumption: --overlap-grad-reduce / --overlap-param-gather
    pp: float = 0.8   # assumption: P2P sends overlap the 1F1B steady state

    def __post_init__(self) -> None:
        for key in ("tp", "ep", "dp", "pp"):
            fraction(f"overlap.{key}", getattr(self, key))


DEFAULT_OVERLAP = OverlapConfig()
NO_OVERLAP = OverlapConfig(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class IterationBreakdown:
    """Seconds per iteration by part (communication terms are the exposed part)."""

    compute_s: float
    elementwise_s: float
    op_overhead_s: float
    tp_s: float
    ep_s: float
    dp_s: float
    pp_s: float
    bubble_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.elementwise_s + self.op_overhead_s + self.tp_s + self.ep_s + self.dp_s + self.pp_s
                + self.bubble_s + self.optimizer_s)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}


@dataclass(frozen=True)
class MemoryBreakdown:
    """GB of device memory per GPU during training."""

    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    runtime_gb: float

    @property
    def total_gb(self) -> float:
        return (self.weights_gb + self.grads_gb + self.optimizer_gb + self.activations_gb
                + self.runtime_gb)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_gb": self.total_gb}


@dataclass(frozen=True)
class GpuShare:
    """Parameters held by one GPU: dense-like and routed-expert weights, and their
    optimizer shards (what its AdamW step updates)."""

    dense: float
    expert: float
    dense_shard: float
    expert_shard: float

    @property
    def weights(self) -> float:
        return self.dense + self.expert

    @property
    def shard(self) -> float:
        return self.dense_shard + self.expert_shard


def gpu_share(workload: Workload) -> GpuShare:
    """Per-GPU parameters: dense over TP x PP, routed experts over EP x PP."""
    p, counts = workload.parallel, workload.params
    dense = counts.non_expert / (p.tp * p.pp)
    expert = counts.routed / (p.ep * p.pp)
    if p.sharded_optimizer:
        return GpuShare(dense, expert, dense / p.dp, expert / p.edp)
    return GpuShare(dense, expert, dense, expert)


def checkpoint_bytes_per_gpu(workload: Workload) -> float:
    """Bytes one GPU snapshots for a checkpoint: its FP32 master weights + Adam moments."""
    return gpu_share(workload).shard * OPTIMIZER_STATE_BYTES


def _gemm_eff(hw: HardwareProfile, m: float) -> float:
    return hw.gemm_efficiency * m / (m + hw.gemm_half_dim)


def _flops(workload: Workload) -> tuple[float, float]:
    """Training FLOPs per GPU per iteration: (dense-like, routed experts)."""
    m, p, c = workload.model, workload.parallel, workload.params
    lm_head = m.vocab_size * m.d_model
    dense_token = 2 * (c.attention + c.dense_ffn + c.shared + lm_head)
    dense_token += 2 * m.seq_len * m.d_model * m.n_layers   # causal attention scores
    expert_token = 2 * c.routed_active
    tokens = workload.micro_batches * workload.data.micro_batch * m.seq_len  # per replica
    per_gpu = 3 * tokens / (p.tp * p.pp)
    return dense_token * per_gpu, expert_token * per_gpu


def _compute_s(workload: Workload, hw: HardwareProfile) -> float:
    m, p = workload.model, workload.parallel
    dense_flops, expert_flops = _flops(workload)
    tokens_micro = workload.data.micro_batch * m.seq_len
    widths = [tokens_micro, m.d_model / p.tp]
    if m.n_moe_layers < m.n_layers:
        widths.append(m.ffn_hidden / p.tp)
    seconds = dense_flops / _gemm_eff(hw, min(widths))
    if m.n_experts:
        per_expert = p.ep * tokens_micro / p.tp * m.top_k / m.n_experts
        seconds += expert_flops / _gemm_eff(hw, min(per_expert, m.d_model, m.expert_ffn_hidden))
    return seconds / (hw.peak_tflops * 1e12)


def _link_s(hw: HardwareProfile, nbytes: float, inter_fraction: float, calls: float) -> float:
    """Time to move ``nbytes`` per GPU, a share of it across nodes."""
    if nbytes <= 0:
        return 0.0
    per_byte = (1 - inter_fraction) / hw.nvlink_gbps + inter_fraction / hw.net_gbps
    return nbytes * per_byte / (hw.comm_efficiency * 1e9) + calls * hw.collective_latency_us * 1e-6


def _group_inter_fraction(hw: HardwareProfile, size: int, stride: int) -> float:
    """Share of a ring/all-to-all's traffic leaving the node for a group of ``size`` ranks
    spaced ``stride`` apart (Megatron rank order: tp fastest, then dp, then pp)."""
    if size <= 1:
        return 0.0
    in_node = max(1, min(size, hw.gpus_per_node // max(stride, 1)))
    return 0.0 if in_node >= size else 1.0 - (in_node - 1) / (size - 1)


def _tp_s(workload: Workload, hw: HardwareProfile) -> float:
    m, p = workload.model, workload.parallel
    if p.tp == 1:
        return 0.0
    layers_micro = m.n_layers / p.pp * workload.micro_batches
    nbytes = 8 * (p.tp - 1) / p.tp * workload.data.micro_batch * m.seq_len * m.d_model * BF16
    inter = _group_inter_fraction(hw, p.tp, 1)
    return _link_s(hw, nbytes * layers_micro, inter, 8 * layers_micro)


def _ep_s(workload: Workload, hw: HardwareProfile) -> float:
    m, p = workload.model, workload.parallel
    if not m.n_experts or p.ep == 1:
        return 0.0
    calls = 4 * m.n_moe_layers / p.pp * workload.micro_batches
    tokens = workload.data.micro_batch * m.seq_len / p.tp
    nbytes = tokens * m.top_k * m.d_model * BF16 * (p.ep - 1) / p.ep * calls
    return _link_s(hw, nbytes, _group_inter_fraction(hw, p.ep, 1), calls)


def _dp_s(workload: Workload, hw: HardwareProfile) -> float:
    p = workload.parallel
    share = gpu_share(workload)
    total = 0.0
    for params, size, stride in ((share.dense, p.dp, p.tp), (share.expert, p.edp, p.ep)):
        if size <= 1 or params <= 0:
            continue
        ring = (size - 1) / size
        if p.sharded_optimizer:   # reduce-scatter FP32 grads + all-gather BF16 params
            nbytes = ring * params * (FP32 + BF16)
        else:                     # all-reduce FP32 grads
            nbytes = 2 * ring * params * FP32
        total += _link_s(hw, nbytes, _group_inter_fraction(hw, size, stride), 2)
    return total


def _pp_s(workload: Workload, hw: HardwareProfile) -> float:
    m, p = workload.model, workload.parallel
    if p.pp == 1:
        return 0.0
    per_micro = workload.data.micro_batch * m.seq_len * m.d_model * BF16 / p.tp
    calls = 2 * workload.micro_batches * p.vpp
    inter = _group_inter_fraction(hw, 2, p.tp * p.dp)
    return _link_s(hw, per_micro * calls, inter, calls)


def iteration_time(workload: Workload, hw: HardwareProfile,
                   overlap: OverlapConfig = DEFAULT_OVERLAP) -> IterationBreakdown:
    """Fault-free iteration time of ``workload`` on ``hw``, by part."""
    p = workload.parallel
    compute = _compute_s(workload, hw)
    layers = workload.model.n_layers / p.pp * workload.micro_batches
    elementwise = (ELEMENTWISE_PASSES * _activation_bytes_per_layer(workload) * layers
                   / (HBM_EFFICIENCY * hw.hbm_gbps * 1e9))
    ops = _op_overhead_s(workload, hw)
    tp = _tp_s(workload, hw) * (1 - overlap.tp)
    ep = _ep_s(workload, hw) * (1 - overlap.ep)
    raw_dp = _dp_s(workload, hw)
    dp = max(raw_dp * (1 - overlap.dp), raw_dp - compute * 2 / 3)
    pp = _pp_s(workload, hw) * (1 - overlap.pp)
    stage_micro = (compute + elementwise + ops + tp + ep) / workload.micro_batches
    bubble = (p.pp - 1) / p.vpp * stage_micro
    opt_bytes = gpu_share(workload).shard * ADAM_BYTES_TOUCHED
    optimizer = opt_bytes / (HBM_EFFICIENCY * hw.hbm_gbps * 1e9)
    return IterationBreakdown(compute, elementwise, ops, tp, ep, dp, pp, bubble, optimizer)


def _op_overhead_s(workload: Workload, hw: HardwareProfile) -> float:
    """Host time of the framework ops of one iteration (forward + backward)."""
    if hw.op_overhead_us <= 0:
        return 0.0
    m, p = workload.model, workload.parallel
    per_micro: float = OPS_PER_LAYER * m.n_layers
    if m.n_experts:
        local = m.n_experts / p.ep + m.shared_experts
        per_micro += m.n_moe_layers * (OPS_PER_ROUTER + OPS_PER_EXPERT * local)
    ops = 2 * per_micro / p.pp * workload.micro_batches + OPS_PER_ITERATION
    return ops * hw.op_overhead_us * 1e-6


def _activation_bytes_per_layer(workload: Workload) -> float:
    """Activation bytes of one layer and one micro-batch on one GPU (averaged over layers)."""
    m, p = workload.model, workload.parallel
    per_layer = ACT_BYTES_PER_SBH * workload.data.micro_batch * m.seq_len * m.d_model / p.tp
    if m.n_experts:   # gate/up/activation of the experts a token visits, per MoE layer
        moe = workload.data.micro_batch * m.seq_len / p.tp * m.top_k * 3 * m.expert_ffn_hidden * BF16
        per_layer += moe * m.n_moe_layers / m.n_layers
    return per_layer


def memory_per_gpu(workload: Workload) -> MemoryBreakdown:
    """Training memory per GPU: BF16 weights, FP32 main grads, optimizer shard, activations
    (1F1B keeps min(pp, micro-batches) micro-batches in flight on the first stage)."""
    m, p = workload.model, workload.parallel
    share = gpu_share(workload)
    per_layer = _activation_bytes_per_layer(workload)
    in_flight = min(p.pp, workload.micro_batches)
    activations = per_layer * math.ceil(m.n_layers / p.pp) * in_flight
    return MemoryBreakdown(
        weights_gb=share.weights * BF16 / 1e9, grads_gb=share.weights * FP32 / 1e9,
        optimizer_gb=share.shard * OPTIMIZER_STATE_BYTES / 1e9,
        activations_gb=activations / 1e9, runtime_gb=RUNTIME_RESERVED_GB)
