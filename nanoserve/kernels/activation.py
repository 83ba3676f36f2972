"""SiLU-and-mul, SwiGLU's gate: silu(gate) * up, elementwise, in one read of each input and one write.

In PyTorch, `F.silu(gate) * up` writes silu(gate) to memory and reads it back: 5 tensor-sized
transfers instead of 3. The kernel keeps the intermediate in registers.
"""
import torch

from nanoserve.kernels._triton import tl, triton


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask).to(tl.float32)
    # silu in fp32, rounded to the input dtype, then the product: the same roundings as F.silu(g) * u
    s = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, s * u, mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of the same shape and dtype."""
    _check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n, block = gate.numel(), 1024
    if n:
        _silu_and_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference (what nanoserve.models.layers.MLP computes)."""
    _check(gate, up)
    return torch.nn.functional.silu(gate) * up


def _check(gate, up):
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_and_mul needs gate and up of one shape and dtype, got gate {list(gate.shape)} "
                         f"{gate.dtype} and up {list(up.shape)} {up.dtype}")
