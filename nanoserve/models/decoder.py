"""The decoder: embedding, N x (attention + MLP, each pre-normed with a residual), final norm, output head.

Module names follow the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`, ...),
so a checkpoint's tensors load by name with no renaming table.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.attention import AttentionBackend
from nanoserve.models.config import ModelConfig
from nanoserve.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention: AttentionBackend | None = None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attention)
        # x + attn, then its norm: one fused pass (add + RMSNorm) on the Triton backend (chapter 05)
        h, x = self.post_attention_layernorm(attn, x)
        return x + self.mlp(h)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids, positions, attention: AttentionBackend | None = None):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder-only language model.

    `model(input_ids)` with input_ids LongTensor[B, T] returns logits FloatTensor[B, T, vocab] for
    positions 0..T-1, no cache. With `attention`, an AttentionBackend (a KV cache from chapter 02 on), the
    same call runs one step of a cached prefill or decode: `positions` says where each token sits in its
    sequence.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_kernels(self, ops) -> "CausalLM":
        """Run the norms, gate, rotary (and attention through a cache) with `ops`, a kernels.KernelSet."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):   # the layers that call kernels
                module.ops = ops
        return self

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention: AttentionBackend | None = None):
        """The final-norm hidden states [B, T, hidden]; the engine applies the head only where it samples."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.model(input_ids, positions, attention)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention: AttentionBackend | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, positions, attention))
