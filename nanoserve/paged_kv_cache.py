"""Chapter 04: the paged KV cache. Keys and values live in fixed-size blocks; attention reads them
through each sequence's block table.

Storage, per layer: `num_blocks` blocks of `block_size` positions ([block, offset, kv_head, head_dim]).
Token position p of a sequence with block table T sits at flat row `T[p // block_size] * block_size +
p % block_size` of the layer's [num_blocks * block_size, kv_head, head_dim] view. A step is varlen, as
in chapter 02: `prepare()` turns the step's block tables into row indices once, and every layer uses
them to write the new keys/values and to gather what each query attends to.

This PyTorch path is the reference that chapter 05's Triton kernels match (`paged_decode_attention`
reads the blocks in place instead of gathering them); `NANOSERVE_KERNELS=triton` switches to them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.models.config import ModelConfig


@dataclass
class PagedStep:
    """Row indices for one step, built once and shared by every layer."""
    new_rows: torch.Tensor          # [N] flat cache row of each new token
    decode_tokens: torch.Tensor     # [D] which of the N tokens are single-token (decode) sequences
    decode_rows: torch.Tensor       # [D, ctx] flat rows each decode attends to (padded with row 0)
    decode_mask: torch.Tensor       # [D, 1, 1, ctx] True where a key is attended
    decode_tables: torch.Tensor     # [D, max_blocks] int32 block tables, -1 past the end (Triton path)
    decode_context: torch.Tensor    # [D] int32 keys per decode
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (first token, new tokens, start, rows [ctx])


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device="cpu", dtype=torch.float32):
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # zeros, not empty: padded rows are masked out, but 0 * NaN garbage would still poison the sum
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5
        self.step: PagedStep | None = None

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype=torch.float32) -> int:
        """K and V of `block_size` positions in every layer."""
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _rows(self, table: list[int], start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def prepare(self, block_tables: list[list[int]], starts: list[int], lengths: list[int]) -> None:
        """Describe the next forward: sequence i writes `lengths[i]` tokens at positions `starts[i]..`."""
        dev, bs = self.k.device, self.block_size
        new_rows, decode_tokens, decode_tables, decode_ctx, prefills = [], [], [], [], []
        offset = 0
        for table, start, n in zip(block_tables, starts, lengths):
            if len(table) * bs < start + n:
                raise ValueError(f"block table {table} covers {len(table) * bs} positions; the step needs {start + n}")
            new_rows += self._rows(table, start, start + n)
            if n == 1:
                decode_tokens.append(offset)
                decode_tables.append(table)
                decode_ctx.append(start + 1)
            else:
                prefills.append((offset, n, start, torch.tensor(self._rows(table, 0, start + n), device=dev)))
            offset += n
        ctx = max(decode_ctx, default=0)
        width = max((len(t) for t in decode_tables), default=0)
        tables = torch.tensor([t + [-1] * (width - len(t)) for t in decode_tables], dtype=torch.int32,
                              device=dev).reshape(len(decode_tables), width)
        context = torch.tensor(decode_ctx, dtype=torch.int32, device=dev)
        pos = torch.arange(ctx, device=dev)
        mask = pos[None, :] < context[:, None]
        if self.sliding_window is not None:
            mask &= pos[None, :] >= context[:, None] - self.sliding_window
        blocks = tables.clamp(min=0).long().gather(1, (pos // bs).expand(len(decode_tables), ctx)) if ctx else \
            torch.zeros(len(decode_tables), 0, dtype=torch.long, device=dev)
        rows = torch.where(mask, blocks * bs + pos % bs, 0)
        self.step = PagedStep(torch.tensor(new_rows, device=dev), torch.tensor(decode_tokens, device=dev, dtype=torch.long),
                              rows, mask[:, None, None, :], tables, context, prefills)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v in their blocks, then attention through the block tables. q: [1, N, heads, d]."""
        step = self.step
        if step is None:
            raise RuntimeError("PagedKVCache.prepare() must describe the step before the forward pass")
        from nanoserve import kernels  # chapter 05; imported late so chapter 04 stands without it
        q, k, v = q[0], k[0], v[0]
        use_triton = kernels.use_triton(q)
        kc, vc = self.k[layer], self.v[layer]
        _, _, kvh, d = kc.shape
        kflat, vflat = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
        kflat.index_copy_(0, step.new_rows, k)
        vflat.index_copy_(0, step.new_rows, v)
        out = torch.empty_like(q)
        D = len(step.decode_tokens)
        if D and use_triton:
            out[step.decode_tokens] = kernels.paged_decode_attention(
                q[step.decode_tokens], kc, vc, step.decode_tables, step.decode_context, self.scale, self.sliding_window)
        elif D:  # all decodes together: gather each one's keys (padded to the longest), mask the padding
            rows = step.decode_rows.flatten()
            keys = kflat.index_select(0, rows).view(D, -1, kvh, d).transpose(1, 2)   # [D, kv_heads, ctx, d]
            vals = vflat.index_select(0, rows).view(D, -1, kvh, d).transpose(1, 2)
            qd = q[step.decode_tokens].unsqueeze(2)                                   # [D, heads, 1, d]
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=step.decode_mask, enable_gqa=True)
            out[step.decode_tokens] = o.squeeze(2)
        for first, n, start, rows in step.prefills:
            qs = q[first:first + n].transpose(0, 1)                                   # [heads, n, d]
            keys = kflat.index_select(0, rows).transpose(0, 1)                        # [kv_heads, ctx, d]
            vals = vflat.index_select(0, rows).transpose(0, 1)
            if use_triton:
                o = kernels.flash_prefill(qs, keys, vals, start, self.scale, self.sliding_window)
            else:
                o = prefill_attention(qs[None], keys[None], vals[None], start, self.sliding_window)[0]
            out[first:first + n] = o.transpose(0, 1)
        return out[None]


def prefill_attention(q, k, v, start: int, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of n new queries at positions start..start+n-1 over keys 0..start+n-1.
    q [B, heads, n, d]; k, v [B, kv_heads, start + n, d]."""
    n, ctx = q.shape[2], k.shape[2]
    if start == 0 and sliding_window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    qpos = torch.arange(start, ctx, device=q.device)[:, None]
    kpos = torch.arange(ctx, device=q.device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
