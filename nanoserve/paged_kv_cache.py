"""Chapter 04: the paged KV cache. Keys and values live in fixed-size blocks; attention reads them
through each sequence's block table.

Storage, per layer: `num_blocks` blocks of `block_size` positions ([block, offset, kv_head, head_dim]).
Token position p of a sequence with block table T sits at flat row `T[p // block_size] * block_size +
p % block_size` of the layer's [num_blocks * block_size, kv_head, head_dim] view. A step is varlen, as
in chapter 02: `prepare()` turns the step's block tables into indices once, and every layer uses them
to write the new keys/values (by row) and to gather the blocks each query attends to.

This PyTorch path is the reference that chapter 05's Triton kernels match (`paged_decode_attention`
reads the blocks in place instead of gathering them); `NANOSERVE_KERNELS=triton` switches to them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve import kernels  # chapter 05: the Triton path of the same attention
from nanoserve.kv_cache import KVCache, prefill_attention
from nanoserve.models.config import ModelConfig
from nanoserve.models.layers import causal_mask


@dataclass
class DecodeGroup:
    """Decodes of similar length, attended together: their blocks gathered and padded to the longest."""
    tokens: torch.Tensor            # [G] which of the step's N tokens
    blocks: torch.Tensor            # [G, max_blocks] block ids (padding: block 0, masked)
    mask: torch.Tensor              # [G, 1, 1, max_blocks * block_size] True where a key is attended


@dataclass
class PagedStep:
    """Indices for one step, built once and shared by every layer."""
    new_rows: torch.Tensor          # [N] flat cache row of each new token
    decode_tokens: torch.Tensor     # [D] which of the N tokens are single-token (decode) sequences
    decode_tables: torch.Tensor     # [D, max_blocks] int32 block tables, -1 past the end (Triton path)
    decode_context: torch.Tensor    # [D] int32 keys per decode
    decode_groups: list[DecodeGroup]  # the same decodes, grouped by length (PyTorch path)
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (first token, new tokens, start, its blocks)


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
        return block_size * KVCache.bytes_per_token(cfg, dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prepare(self, block_tables: list[list[int]], starts: list[int], lengths: list[int]) -> None:
        """Describe the next forward: sequence i writes `lengths[i]` tokens at positions `starts[i]..`."""
        dev, bs = self.k.device, self.block_size
        new_rows, decode_tokens, decode_tables, decode_ctx, prefills = [], [], [], [], []
        offset = 0
        for table, start, n in zip(block_tables, starts, lengths):
            if len(table) * bs < start + n:
                raise ValueError(f"block table {table} covers {len(table) * bs} positions; the step needs {start + n}")
            new_rows += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            used = table[:-(-(start + n) // bs)]
            if n == 1:
                decode_tokens.append(offset)
                decode_tables.append(used)
                decode_ctx.append(start + 1)
            else:
                prefills.append((offset, n, start, torch.tensor(used, device=dev)))
            offset += n
        width = max((len(t) for t in decode_tables), default=0)
        tables = torch.tensor([t + [-1] * (width - len(t)) for t in decode_tables], dtype=torch.int32,
                              device=dev).reshape(len(decode_tables), width)
        context = torch.tensor(decode_ctx, dtype=torch.int32, device=dev)
        groups = []
        order = sorted(range(len(decode_tables)), key=lambda i: len(decode_tables[i]))
        for lo, hi in split_by_length([len(decode_tables[i]) for i in order]):
            rows = order[lo:hi]
            w = len(decode_tables[rows[-1]])
            pos = torch.arange(w * bs, device=dev)
            mask = causal_mask(pos[None, :], context[rows, None] - 1, self.sliding_window)  # query at context - 1
            groups.append(DecodeGroup(torch.tensor([decode_tokens[i] for i in rows], device=dev),
                                      tables[rows, :w].clamp(min=0).long(), mask[:, None, None, :]))
        self.step = PagedStep(torch.tensor(new_rows, device=dev), torch.tensor(decode_tokens, device=dev, dtype=torch.long),
                              tables, context, groups, prefills)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v in their blocks, then attention through the block tables. q: [1, N, heads, d]."""
        step = self.step
        if step is None:
            raise RuntimeError("PagedKVCache.prepare() must describe the step before the forward pass")
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
        elif D:  # decodes of similar length together: gather their blocks (padded to the longest), mask
            for g in step.decode_groups:
                G = len(g.tokens)
                blocks = g.blocks.flatten()      # whole blocks: a few large copies, not many small ones
                keys = kc.index_select(0, blocks).view(G, -1, kvh, d).transpose(1, 2)  # [G, kv_heads, ctx, d]
                vals = vc.index_select(0, blocks).view(G, -1, kvh, d).transpose(1, 2)
                qd = q[g.tokens].unsqueeze(2)                                          # [G, heads, 1, d]
                o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=g.mask, enable_gqa=True)
                out[g.tokens] = o.squeeze(2)
        for first, n, start, blocks in step.prefills:
            qs = q[first:first + n].transpose(0, 1)                                   # [heads, n, d]
            keys = kc.index_select(0, blocks).view(-1, kvh, d)[:start + n].transpose(0, 1)   # [kv_heads, ctx, d]
            vals = vc.index_select(0, blocks).view(-1, kvh, d)[:start + n].transpose(0, 1)
            if use_triton:
                o = kernels.flash_prefill(qs, keys, vals, start, self.scale, self.sliding_window)
            else:
                o = prefill_attention(qs[None], keys[None], vals[None], start, self.sliding_window)[0]
            out[first:first + n] = o.transpose(0, 1)
        return out[None]


def split_by_length(num_blocks: list[int], max_groups: int = 4, group_cost: int = 16) -> list[tuple[int, int]]:
    """Cut sorted per-sequence block counts into at most `max_groups` runs [lo, hi) that waste less.

    A group costs its size x its longest (the padding is gathered and attended too), plus a fixed
    `group_cost` in blocks for the extra calls. Each run is split in two at its best point while that pays.
    """
    def padded(lo, hi):
        return (hi - lo) * num_blocks[hi - 1] if hi > lo else 0

    runs = [(0, len(num_blocks))] if num_blocks else []
    while len(runs) < max_groups:
        best = None  # (saving, run index, cut)
        for r, (lo, hi) in enumerate(runs):
            for cut in range(lo + 1, hi):
                saving = padded(lo, hi) - padded(lo, cut) - padded(cut, hi) - group_cost
                if saving > 0 and (best is None or saving > best[0]):
                    best = (saving, r, cut)
        if best is None:
            break
        _, r, cut = best
        lo, hi = runs.pop(r)
        runs[r:r] = [(lo, cut), (cut, hi)]
    return runs
