"""Paged decode attention: one new query per sequence, its keys and values scattered over cache blocks.

The paged KV cache (chapter 04) stores each layer's keys as [num_blocks, block_size, kv_heads, d]; a
sequence owns a list of blocks, in any order, written in its row of `block_tables`. To attend, a
program walks the sequence's logical blocks 0, 1, 2, ...: it loads the physical block id from the
table, turns it into the address of that block's keys (block id * block stride), and runs the online
softmax over the block's `block_size` keys. Table entries past the sequence's last block (-1) are
never loaded.

One program per (sequence, kv head) serves all the query heads that share that kv head (GQA): the
keys and values are read from memory once for the whole group, which is what makes decode attention's
bytes, and therefore its time, shrink with the number of kv heads.
"""
import torch

from nanoserve.kernels._triton import tl, triton


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, window,
                         q_stride_b, q_stride_h, k_stride_blk, k_stride_t, k_stride_h,
                         v_stride_blk, v_stride_t, v_stride_h, o_stride_b, o_stride_h, tables_stride_b,
                         group, block_size, head_dim,
                         BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)          # query heads of this kv head's group: kv_head * group + g
    t = tl.arange(0, BLOCK_T)          # key slots within a block
    d = tl.arange(0, BLOCK_D)
    g_mask, d_mask = g < group, d < head_dim
    heads = kv_head * group + g

    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)   # [G, D]
    n_keys = tl.load(lens_ptr + seq)
    first_key = tl.maximum(n_keys - window, 0)       # window = n_keys when there is no sliding window

    m = tl.full([BLOCK_G], -1e30, tl.float32)   # running max score (finite: a fully masked block adds 0)
    l = tl.zeros([BLOCK_G], tl.float32)         # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for logical in range(first_key // block_size, tl.cdiv(n_keys, block_size)):
        block = tl.load(tables_ptr + seq * tables_stride_b + logical).to(tl.int64)   # physical block id
        pos = logical * block_size + t
        t_mask = (t < block_size) & (pos < n_keys) & (pos >= first_key)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + block * k_stride_blk + t[:, None] * k_stride_t + kv_head * k_stride_h + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)                          # [T, D]
        v = tl.load(v_ptr + block * v_stride_blk + t[:, None] * v_stride_t + kv_head * v_stride_h + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                   # [G, T]
        s = tl.where(t_mask[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)                   # rescales what was summed under the old max
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]       # a sequence with no keys gets zeros, not NaN
    tl.store(out_ptr + seq * o_stride_b + heads[:, None] * o_stride_h + d[None, :],
             out, mask=g_mask[:, None] & d_mask[None, :])


def _check(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {list(k_cache.shape)} and {list(v_cache.shape)}")
    B, H, D = q.shape
    Hk = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {D}")
    if H % Hk:
        raise ValueError(f"num_heads {H} of q is not a multiple of num_kv_heads {Hk} of k_cache")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but k_cache is {k_cache.dtype} and v_cache {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [batch={B}, max_blocks], got {block_tables.dtype} "
                         f"{list(block_tables.shape)}")
    if context_lens.shape != (B,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [batch={B}], got {context_lens.dtype} {list(context_lens.shape)}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """Attention of q [B, num_heads, d] over each sequence's first `context_lens[b]` cached keys.

    k_cache, v_cache: one layer, [num_blocks, block_size, num_kv_heads, d]. block_tables: int32
    [B, max_blocks], the physical block of each logical block (-1 past the end, never read).
    context_lens: int32 [B]. With `sliding_window` W only the last W keys count. Returns [B, num_heads, d]
    in q's dtype (sums in fp32).
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    _, block_size, Hk, _ = k_cache.shape
    group = H // Hk
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim")
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    out = torch.empty_like(q)
    window = sliding_window if sliding_window is not None else 2**31 - 1
    if B:
        _paged_decode_kernel[(B, Hk)](
            q, k_cache, v_cache, out, tables, context_lens, float(scale), window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), tables.stride(0),
            group, block_size, D, BLOCK_G=triton.next_power_of_2(group),
            BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(D))
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
    """The PyTorch reference: gather each sequence's blocks into a contiguous [B, kv_heads, ctx, d], then SDPA."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    block_size = k_cache.shape[1]
    lens = context_lens.long()
    max_len = int(lens.max()) if B else 0
    if max_len == 0:
        return torch.zeros_like(q)
    n_blocks = -(-max_len // block_size)
    # -1 (unused) entries are pointed at block 0 for the gather; the mask below hides whatever it holds
    tables = block_tables[:, :n_blocks].long().clamp(min=0)

    def gather(cache):
        blocks = cache[tables]                                      # [B, n_blocks, block_size, kv_heads, d]
        return blocks.flatten(1, 2)[:, :max_len].transpose(1, 2)    # [B, kv_heads, max_len, d]

    pos = torch.arange(max_len, device=q.device)
    mask = pos[None, :] < lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= lens[:, None] - sliding_window
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], gather(k_cache), gather(v_cache), attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=True)[:, :, 0]
    return torch.where((lens > 0)[:, None, None], out, 0.0).to(q.dtype)
