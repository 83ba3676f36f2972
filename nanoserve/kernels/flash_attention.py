"""Flash-attention style prefill: causal attention of a chunk of new queries, tiled, with an online softmax.

Plain attention materialises the [Tq, Tk] score matrix in memory. Here a program owns BLOCK_M queries
of one head and walks the keys BLOCK_N at a time: scores for one tile live in registers, the running
row max `m` and row sum `l` let earlier partial sums be rescaled when a larger score appears, and the
output is written once. Memory traffic drops from O(Tq * Tk) to O((Tq + Tk) * d) per head.

Query i of the chunk sits at absolute position q_offset + i (a later chunk of a long prompt, chunked
prefill) and sees keys 0..q_offset + i, or only the last `sliding_window` of them. Query head h reads
kv head h // (num_heads / num_kv_heads) (GQA).
"""
import torch

from nanoserve.kernels._triton import tl, triton


@triton.jit
def _flash_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, scale, q_offset, n_q, n_k, window, group, head_dim,
                          q_stride_h, q_stride_t, k_stride_h, k_stride_t, v_stride_h, v_stride_t,
                          o_stride_h, o_stride_t,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)       # query rows of this tile
    d = tl.arange(0, BLOCK_D)
    q_mask = (m_idx[:, None] < n_q) & (d[None, :] < head_dim)
    q = tl.load(q_ptr + head * q_stride_h + m_idx[:, None] * q_stride_t + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:  # Triton's interpreter cannot multiply bf16 numbers: give its tl.dot fp32
        q = q.to(tl.float32)
    q_pos = q_offset + m_idx                             # absolute positions of the queries

    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # only the key tiles some query of this tile can see: from the window's start to the last query
    lo = tl.maximum(q_offset + tile * BLOCK_M - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(q_offset + (tile + 1) * BLOCK_M, n_k)
    for start in range(lo, hi, BLOCK_N):
        n_idx = start + tl.arange(0, BLOCK_N)
        kv_mask = (n_idx[:, None] < n_k) & (d[None, :] < head_dim)
        k = tl.load(k_ptr + kv_head * k_stride_h + n_idx[:, None] * k_stride_t + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_head * v_stride_h + n_idx[:, None] * v_stride_t + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale          # [BLOCK_M, BLOCK_N], fp32
        visible = (n_idx[None, :] <= q_pos[:, None]) & (n_idx[None, :] > q_pos[:, None] - window) \
            & (n_idx[None, :] < n_k)
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + head * o_stride_h + m_idx[:, None] * o_stride_t + d[None, :], out, mask=q_mask)


def _check(q, k, v, q_offset):
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"q must be [num_heads, Tq, d] and k, v [num_kv_heads, Tk, d]; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    H, Tq, D = q.shape
    Hk, Tk, Dk = k.shape
    if Dk != D:
        raise ValueError(f"k head_dim {Dk} != q head_dim {D}")
    if H % Hk:
        raise ValueError(f"num_heads {H} of q is not a multiple of num_kv_heads {Hk} of k")
    if Tk != q_offset + Tq:
        raise ValueError(f"k has {Tk} positions but q_offset + Tq = {q_offset} + {Tq}: the keys must be "
                         "exactly those of positions 0 .. q_offset + Tq - 1")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but k is {k.dtype} and v {v.dtype}")


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,
                  sliding_window: int | None = None, block_m: int | None = None,
                  block_n: int | None = None) -> torch.Tensor:
    """Causal attention: q [num_heads, Tq, d] at positions q_offset.., k/v [num_kv_heads, q_offset + Tq, d].

    Returns [num_heads, Tq, d] in q's dtype. fp32 inputs multiply in full fp32 (no TF32), so the
    kernel agrees with the fp32 reference; bf16/fp16 use tensor cores with fp32 sums.
    block_m x block_n is the tile of queries x keys a program handles per step (default 64 x 64 on a
    GPU, 32 x 32 in the interpreter, where fewer, larger programs run faster).
    """
    _check(q, k, v, q_offset)
    H, Tq, D = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous head_dim")
    out = torch.empty_like(q)
    window = sliding_window if sliding_window is not None else 2**31 - 1
    default = 64 if q.device.type == "cuda" else 32
    block_m, block_n = block_m or default, block_n or default
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {b}")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"   # "tf32" is ignored for 16-bit inputs
    upcast = q.dtype == torch.bfloat16 and q.device.type != "cuda"   # the interpreter's bf16 arithmetic is broken
    if Tq:
        _flash_prefill_kernel[(triton.cdiv(Tq, block_m), H)](
            q, k, v, out, float(scale), int(q_offset), Tq, k.shape[1], window, H // k.shape[0], D,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), PRECISION=precision, UPCAST=upcast)
    return out


def flash_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,
                      sliding_window: int | None = None) -> torch.Tensor:
    """The PyTorch reference: SDPA with an explicit [Tq, Tk] causal (and window) mask."""
    _check(q, k, v, q_offset)
    Tq, Tk = q.shape[1], k.shape[1]
    q_pos = torch.arange(q_offset, q_offset + Tq, device=q.device)[:, None]
    k_pos = torch.arange(Tk, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)[0]
