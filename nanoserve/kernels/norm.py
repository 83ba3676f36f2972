"""RMSNorm, and RMSNorm fused with the residual add that precedes it in every decoder layer.

A decoder layer does `h = h + attn(...)` then `norm(h)`: in PyTorch the sum is written to memory,
read back to compute its mean square, read again to scale. The fused kernel reads x and the residual
once, keeps the row in registers, and writes both the new residual and its normalised copy.
One program per row (token); the row's statistics are computed in fp32 whatever the input dtype,
exactly as `nanoserve.models.layers.RMSNorm` does.
"""
import torch

from nanoserve.kernels._triton import tl, triton


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                     x_stride, res_stride, out_stride, new_res_stride,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    # arithmetic in fp32 (Triton's interpreter cannot add bf16 numbers), rounded to the input dtype
    # where PyTorch rounds: after the add, and before the weight multiply
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # a constexpr: the branch is resolved when the kernel is compiled, not per row
        x = x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dtype).to(tl.float32)
        tl.store(new_res_ptr + row * new_res_stride + cols, x, mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)   # padding is 0: it adds nothing
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * inv_rms).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * out_stride + cols, normed, mask=mask)


def _rows(t: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    if t.shape[-1] != hidden:
        raise ValueError(f"{name} has last dimension {t.shape[-1]}, expected the weight's {hidden}")
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, residual, weight, eps):
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D [hidden], got shape {list(weight.shape)}")
    hidden = weight.shape[0]
    x2 = _rows(x, "x", hidden)
    res2 = _rows(residual, "residual", hidden) if residual is not None else x2
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {list(residual.shape)} {residual.dtype} must match x {list(x.shape)} {x.dtype}")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, new_res, hidden, float(eps),
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out.view(x.shape), new_res.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension; x [..., hidden], weight [hidden]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the normalised input of the next sublayer, and the new residual."""
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The PyTorch reference, step for step what `nanoserve.models.layers.RMSNorm` computes."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has last dimension {x.shape[-1]}, expected the weight's {weight.shape[-1]}")
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The PyTorch reference: the add, then the norm, as two separate passes over memory."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)} must match x {list(x.shape)}")
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
