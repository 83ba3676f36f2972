"""The parts of a Llama-family decoder: RMSNorm, rotary embeddings, attention, the SwiGLU MLP.

Each part computes exactly what transformers computes, in the same order and precision
(norms in fp32, rotary tables in fp32), so logits match to rounding.

Chapter 05: the norms, the SwiGLU gate and the rotary embedding call `self.ops`, a
`nanoserve.kernels.KernelSet`: the PyTorch references until an engine picks its backend once
(`CausalLM.use_kernels`), e.g. the Triton kernels on CUDA, which round where the references round.
Attention itself is `nanoserve.attention`: without a cache here, through the cache the caller hands in.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nanoserve import kernels
from nanoserve.attention import AttentionBackend, causal_attention
from nanoserve.models.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the input dtype.

    `norm(x, residual)` first adds the residual and returns (normed, x + residual): the fused form a
    decoder layer can use so that the sum is read once (one Triton kernel on that backend).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = kernels.REFERENCE   # kernels.norm.rms_norm_ref: x.float() * rsqrt(mean(x^2) + eps), then * weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation speed of each pair of dimensions (radians per position), with rope scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: slow (long-wavelength) pairs are stretched by `factor`, fast ones kept, the band between blended.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        stretched = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * stretched / factor + smooth * stretched
        in_band = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        inv_freq = torch.where(in_band, blended, stretched)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos and sin tables for given positions; the rotation is applied by `apply_rotary`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self._inv_freq: torch.Tensor | None = None  # made on first use, on the positions' device

    def materialize(self, device: torch.device) -> None:
        """Make the frequency table on `device` now (an engine does, before compiling a step: traced
        inside a graph, the first-use branch below would be guarded on and recompiled next step)."""
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = rope_inv_freq(self.cfg).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.materialize(positions.device)
        freqs = positions.float()[..., None] * self._inv_freq    # [..., head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                   # [..., head_dim]
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, head_dim] by cos/sin [B, T, head_dim] (the "rotate half" layout)."""
    cos, sin = cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention: `num_attention_heads` query heads share `num_key_value_heads` k/v heads."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sliding_window = cfg.sliding_window
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.ops = kernels.REFERENCE

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBackend | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary_embedding(q, k, cos, sin)   # in place, q and k in one call (one kernel on Triton)
        if attention is None:
            out = causal_attention(q, k, v, self.sliding_window)
        else:  # the backend stores this step's k/v and attends over everything the sequence has seen
            out = attention.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops = kernels.REFERENCE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up; one pass instead of silu's write and read-back with the Triton kernel
        return self.down_proj(self.ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))
