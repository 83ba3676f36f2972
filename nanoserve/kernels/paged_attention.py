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

Split-KV (flash-decoding): batch x kv heads programs are too few to keep a GPU's memory busy when the batch
is small or the context long (each program walks its blocks one after another). With `num_splits` S > 1 each
(sequence, kv head) is split over S programs, each walking one stretch of the sequence's blocks and writing its
partial softmax (running max, sum and unnormalised output); a second small kernel combines the S partials per
head. S follows from the block table's width, never from the context lengths on the device, so choosing it
needs no host sync and a captured CUDA graph keeps one grid per table width.
"""
import torch

from nanoserve.device import sm_count
from nanoserve.kernels._triton import tl, triton
from nanoserve.validation import check_int


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ml_ptr, part_acc_ptr, tables_ptr, lens_ptr, scale,
                         window, blocks_per_split,
                         q_stride_b, q_stride_h, k_stride_blk, k_stride_t, k_stride_h,
                         v_stride_blk, v_stride_t, v_stride_h, o_stride_b, o_stride_h, tables_stride_b,
                         group, block_size, head_dim,
                         SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)           # 0 unless SPLIT: which stretch of the sequence's blocks this program walks
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
    first_block, end_block = first_key // block_size, tl.cdiv(n_keys, block_size)
    if SPLIT:                                        # this program's stretch; past the sequence's end it is empty
        first_block = tl.maximum(first_block, split * blocks_per_split)
        end_block = tl.minimum(end_block, (split + 1) * blocks_per_split)
    for logical in range(first_block, end_block):
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
    if SPLIT:   # the partial softmax of this stretch, per head: [max, sum] and the unnormalised output
        part = (seq * tl.num_programs(1) * group + heads) * tl.num_programs(2) + split
        tl.store(part_ml_ptr + part * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    else:
        out = acc / tl.maximum(l, 1e-30)[:, None]   # a sequence with no keys gets zeros, not NaN
        tl.store(out_ptr + seq * o_stride_b + heads[:, None] * o_stride_h + d[None, :],
                 out, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits_kernel(part_ml_ptr, part_acc_ptr, out_ptr, num_splits, head_dim, o_stride_b, o_stride_h,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per (sequence, query head): rescale each stretch's partial to the largest max, then normalise
    seq, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_mask, d_mask = s < num_splits, d < head_dim
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=-1e30)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                  other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))          # an empty stretch (max -1e30) weighs 0 beside any real one
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq * o_stride_b + head * o_stride_h + d, out, mask=d_mask)


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


# Split-KV policy: enough programs to give every SM many (memory latency is hidden by many loads in flight: the
# recorded H200 run reached 11% of HBM with 512 programs on 132 SMs, about 4 per SM), each walking at least a few
# blocks (a shorter stretch costs more in partials than it saves)
PROGRAMS_PER_SM = 16
MIN_BLOCKS_PER_SPLIT = 8
MAX_SPLITS = 32


def decode_splits(batch: int, kv_heads: int, table_blocks: int, sms: int) -> int:
    """How many programs each (sequence, kv head) is split over on a GPU of `sms` SMs: 1 where batch x kv heads
    already fill it, more where they are few and the table (its width in blocks) long."""
    if batch * kv_heads == 0:
        return 1
    wanted = -(-PROGRAMS_PER_SM * sms // (batch * kv_heads))
    return max(1, min(wanted, table_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of q [B, num_heads, d] over each sequence's first `context_lens[b]` cached keys.

    k_cache, v_cache: one layer, [num_blocks, block_size, num_kv_heads, d]. block_tables: int32
    [B, max_blocks], the physical block of each logical block (-1 past the end, never read).
    context_lens: int32 [B]. With `sliding_window` W only the last W keys count. Returns [B, num_heads, d]
    in q's dtype (sums in fp32). num_splits: programs per (sequence, kv head), split-KV (the module's
    docstring); None picks it from the GPU's SM count and the table's width (`decode_splits`), 1 off the GPU.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    _, block_size, Hk, _ = k_cache.shape
    group = H // Hk
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim")
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    if num_splits is None:   # the interpreter (off the GPU) gains nothing from more programs
        num_splits = 1 if q.device.type != "cuda" else decode_splits(B, Hk, tables.shape[1], sm_count(q.device))
    else:
        check_int("num_splits", num_splits)
    splits = max(1, min(num_splits, tables.shape[1]))         # a stretch holds one block at least
    per_split = -(-tables.shape[1] // splits)
    out = torch.empty_like(q)
    window = sliding_window if sliding_window is not None else 2**31 - 1
    if not B:
        return out
    # the partials: [B, H, S, 2] (max, sum) and [B, H, S, D] in fp32; never allocated without a split
    part_ml = torch.empty(B, H, splits, 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    part_acc = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device) if splits > 1 else out
    _paged_decode_kernel[(B, Hk, splits)](
        q, k_cache, v_cache, out, part_ml, part_acc, tables, context_lens, float(scale), window, per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), tables.stride(0),
        group, block_size, D, SPLIT=splits > 1, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(D))
    if splits > 1:
        _combine_splits_kernel[(B, H)](part_ml, part_acc, out, splits, D, out.stride(0), out.stride(1),
                                       BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(D))
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
