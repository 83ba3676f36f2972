"""The teaching kernel: a numerically safe softmax over each row of a 2-D tensor.

One *program* (one instance of the kernel) handles one row. It builds a block of column offsets
with `tl.arange`, turns them into pointers (base + row * row_stride + column), loads with a *mask*
so that a row shorter than the block reads nothing past its end, and subtracts the row's maximum
before `exp` so that large logits cannot overflow.
"""
import torch

from nanoserve.kernels._triton import tl, triton


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)                        # which row this program owns
    cols = tl.arange(0, BLOCK)                    # 0, 1, ..., BLOCK-1 (BLOCK is a power of two)
    mask = cols < n_cols                          # the block may be wider than the row
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)                     # the largest entry becomes exp(0) = 1: no overflow
    num = tl.exp(x)                               # padding was -inf, so it adds exp(-inf) = 0
    out = num / tl.sum(num, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of x [rows, cols] (any float dtype; computed in fp32)."""
    if x.dim() != 2:
        raise ValueError(f"softmax expects x of shape [rows, cols], got {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    rows, cols = x.shape
    # one program per row; the whole row fits in one block (fine up to tens of thousands of columns)
    _softmax_kernel[(rows,)](x, out, cols, x.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(cols))
    return out


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference: softmax in fp32, returned in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"softmax expects x of shape [rows, cols], got {list(x.shape)}")
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
