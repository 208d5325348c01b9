"""A compact decoder-only transformer with optional mixture-of-experts FFNs, in pure torch.

Why in-package and pure torch (see docs/models.md): nothing is downloaded, the tiny forms keep
the shape of the full architectures (GQA, SwiGLU, top-k routing, shared experts, leading dense
layers), the parameter count equals ``count_parameters`` exactly, and it is deterministic on
CPU. It is used below the integration layer (the retained-state and updater code builds it
directly), so it must not import Lightning.

Determinism: expert dispatch loops over experts in index order; each ``index_add_`` call adds
into distinct rows (a token selects an expert at most once), so no sum depends on thread
scheduling.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig

__all__ = ["Attention", "Block", "MoELayer", "MoETransformer", "RMSNorm", "SwiGLU", "build_model"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), as in Llama/Qwen/DeepSeek."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rope_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos/sin tables for rotary position embedding (no parameters, so counts are unchanged)."""
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (GPT-NeoX layout); x is (B, H, T, D)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1) if x.shape[-1] > 2 * half else rotated


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (``n_kv_heads`` <= ``n_heads``) and RoPE."""

    rope_cos: Tensor  # buffers (register_buffer), declared for the type checker
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        d = cfg.d_model
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        cos, sin = _rope_tables(cfg.seq_len, self.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope_cos[:t].to(q.dtype), self.rope_sin[:t].to(q.dtype)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:  # GQA: share each KV head across a query group
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """Gated FFN ``down(silu(gate(x)) * up(x))``: the FFN of Llama/Qwen/OLMoE/DeepSeek experts."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoELayer(nn.Module):
    """Top-k softmax router over ``n_experts`` SwiGLU experts, plus optional shared experts.

    Gates are the un-renormalised softmax probabilities of the selected experts (OLMoE and
    DeepSeekMoE do the same). ``shared_experts`` always-on experts are fused into one SwiGLU
    of width ``shared_experts * expert_ffn_hidden``: the same parameters and the same sum as
    separate experts, in one matmul. The Switch-Transformer load-balancing loss
    ``n_experts * sum_e f_e * P_e`` (1.0 when perfectly balanced) is kept in ``last_aux_loss``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.d_model, cfg.expert_ffn_hidden) for _ in range(cfg.n_experts))
        self.shared: SwiGLU | None = None
        if cfg.shared_experts > 0:
            self.shared = SwiGLU(cfg.d_model, cfg.shared_experts * cfg.expert_ffn_hidden)

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return (gates (N, k), expert ids (N, k), aux loss) for tokens ``flat`` (N, d)."""
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        gates, ids = probs.topk(self.top_k, dim=-1)
        counts = torch.zeros(self.n_experts, dtype=probs.dtype, device=flat.device)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones_like(gates).reshape(-1))
        fraction = counts / ids.numel()
        aux = self.n_experts * torch.sum(fraction * probs.mean(dim=0))
        return gates, ids, aux

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        gates, ids, aux = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            if token.numel() == 0:
                continue
            weight = gates[token, slot].unsqueeze(-1).to(flat.dtype)
            out.index_add_(0, token, expert(flat.index_select(0, token)) * weight)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape), aux


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a dense SwiGLU or an MoE layer."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.is_moe = cfg.layer_is_moe(index)
        self.ffn: nn.Module = MoELayer(cfg) if self.is_moe else SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        x = x + self.attn(self.attn_norm(x))
        if self.is_moe:
            y, aux = self.ffn(self.ffn_norm(x))
            return x + y, aux
        return x + self.ffn(self.ffn_norm(x)), None


class MoETransformer(nn.Module):
    """Decoder-only LM: embedding, ``n_layers`` blocks, final RMSNorm, untied LM head.

    ``forward(tokens)`` returns ``(logits, aux_loss)``; ``aux_loss`` is the mean load-balancing
    loss over MoE layers (a zero tensor for a dense model) so the caller picks its weight.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(tokens)
        aux_losses = []
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                aux_losses.append(aux)
        logits = self.lm_head(self.norm(x))
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else logits.new_zeros(())
        return logits, aux_loss


def build_model(cfg: ModelConfig, seed: int | None = None) -> MoETransformer:
    """Build a model; with ``seed`` the initial weights depend on it alone (forked RNG)."""
    if seed is None:
        return MoETransformer(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoETransformer(cfg)
