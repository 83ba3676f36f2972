"""Rotary position embedding, applied in place to q and k.

Convention of `nanoserve.models.layers` (and Hugging Face): "rotate half". Dimension i of the first
half and dimension i of the second half form a pair, rotated by the angle position * inv_freq[i]:

    out[:d/2] = x[:d/2] * cos - x[d/2:] * sin
    out[d/2:] = x[d/2:] * cos + x[:d/2] * sin

cos/sin come per token as [.., head_dim] with both halves equal (the layout `RotaryEmbedding` makes);
the kernel reads the first half. One program per token rotates all of its query and key heads.
"""
import torch

from nanoserve.kernels._triton import tl, triton


@triton.jit
def _rotate(x_ptr, tok, tok_stride, head_stride, n_heads, cos, sin, half,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    first = x_ptr + tok * tok_stride + heads * head_stride + dims    # [BLOCK_H, BLOCK_HALF] pointers
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    c, s = cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # each product rounded to the input dtype, then the sum: the roundings of the PyTorch expression
    # (added in fp32 and rounded by the store: Triton's interpreter cannot add bf16 numbers)
    out1 = (x1f * c).to(dtype).to(tl.float32) - (x2f * s).to(dtype).to(tl.float32)
    out2 = (x2f * c).to(dtype).to(tl.float32) + (x1f * s).to(dtype).to(tl.float32)
    tl.store(first, out1, mask=mask)
    tl.store(first + half, out2, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
                   cs_stride, n_q_heads, n_k_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + tok * cs_stride + dims, mask=dims < half, other=1.0)   # [1, BLOCK_HALF] fp32
    sin = tl.load(sin_ptr + tok * cs_stride + dims, mask=dims < half, other=0.0)
    _rotate(q_ptr, tok, q_tok_stride, q_head_stride, n_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, tok, k_tok_stride, k_head_stride, n_k_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def _tokens(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., heads, d] as a [tokens, heads, d] view of the same memory (in place needs a view, not a copy)."""
    if x.dim() < 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [..., heads, head_dim] with contiguous head_dim, got shape "
                         f"{list(x.shape)} strides {x.stride()}")
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name}'s leading dimensions cannot be flattened without a copy (strides {x.stride()}); "
                         "rotary_embedding works in place and needs a view") from e


def _check(q, k, cos, sin):
    d = q.shape[-1]
    if d % 2 or k.shape[-1] != d:
        raise ValueError(f"q and k need one even head_dim, got q {list(q.shape)} and k {list(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q is {q.dtype} but k is {k.dtype}")
    tokens = q.numel() // (q.shape[-2] * d)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[-1] != d or t.numel() != tokens * d:
            raise ValueError(f"{name} must be [..., head_dim={d}] with one row per token ({tokens}), got {list(t.shape)}")
    if k.numel() // (k.shape[-2] * d) != tokens:
        raise ValueError(f"q has {tokens} tokens but k has {k.numel() // (k.shape[-2] * d)}")


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [..., heads, d] and k [..., kv_heads, d] in place by cos/sin [..., d]; returns (q, k)."""
    _check(q, k, cos, sin)
    q3, k3 = _tokens(q, "q"), _tokens(k, "k")
    d = q.shape[-1]
    cos2 = cos.reshape(-1, d).float().contiguous()
    sin2 = sin.reshape(-1, d).float().contiguous()
    if q3.shape[0]:
        _rotary_kernel[(q3.shape[0],)](
            q3, k3, cos2, sin2, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos2.stride(0),
            q3.shape[1], k3.shape[1], d // 2, BLOCK_HQ=triton.next_power_of_2(q3.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k3.shape[1]), BLOCK_HALF=triton.next_power_of_2(d // 2))
    return q, k


def rotary_embedding_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The PyTorch reference (`layers.apply_rotary`'s arithmetic), also in place; returns (q, k)."""
    _check(q, k, cos, sin)
    for x in (q, k):
        x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
        c = cos.reshape(-1, 1, x.shape[-1]).to(x.dtype)
        s = sin.reshape(-1, 1, x.shape[-1]).to(x.dtype)
        x1, x2 = x3.chunk(2, dim=-1)
        x.copy_((x3 * c + torch.cat((-x2, x1), dim=-1) * s).view(x.shape))
    return q, k
