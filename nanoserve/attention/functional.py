"""Attention maths in PyTorch, shared by the model without a cache, chapter 02's cache and the paged one.

Shapes follow scaled_dot_product_attention: [batch, heads, tokens, head_dim]. Grouped-query attention
(fewer k/v heads than query heads) is SDPA's `enable_gqa`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(kpos: torch.Tensor, qpos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """True where a query at position qpos may attend a key at kpos: not in its future, and within the
    sliding window when the model has one. Broadcasts: [Tq, 1] against [1, Tk] gives [Tq, Tk]."""
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    return mask


def prefill_attention(q, k, v, start: int, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of n new queries at positions start..start+n-1 over keys 0..start+n-1
    (a prefill, or a later chunk of one). q [B, heads, n, d]; k, v [B, kv_heads, start + n, d]."""
    ctx = k.shape[2]
    if start == 0 and sliding_window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = causal_mask(torch.arange(ctx, device=q.device)[None, :],
                       torch.arange(start, ctx, device=q.device)[:, None], sliding_window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def causal_attention(q, k, v, sliding_window: int | None = None) -> torch.Tensor:
    """Attention without a cache: q [B, T, heads, d], k/v [B, T, kv_heads, d] -> [B, T, heads, d]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return prefill_attention(q, k, v, 0, sliding_window).transpose(1, 2)


def decode_attention(q, k, v, context_lens: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """One query per row over that row's first context_lens[i] keys (padding past them is masked).

    q [D, heads, d]; k, v [D, kv_heads, max_ctx, d]; each query sits at position context_lens[i] - 1.
    """
    pos = torch.arange(k.shape[2], device=q.device)
    mask = causal_mask(pos[None, :], context_lens[:, None] - 1, sliding_window)      # [D, max_ctx]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)
    return out.squeeze(2)
