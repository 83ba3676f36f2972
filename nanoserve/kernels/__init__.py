"""Chapter 05: Triton kernels for the memory-bound parts of a decoder, each beside its PyTorch reference.

    from nanoserve import kernels
    kernels.backend()                       # "triton" or "torch", from NANOSERVE_KERNELS=auto|torch|triton
    out = kernels.silu_and_mul(gate, up)    # the Triton kernel or the reference, whichever backend() says

| module              | op                                   | reference                    |
| ------------------- | ------------------------------------ | ---------------------------- |
| `row_softmax`       | `softmax` (the teaching kernel)      | `softmax_ref`                |
| `norm`              | `rms_norm`, `fused_add_rms_norm`     | `rms_norm_ref`, ...`_ref`    |
| `activation`        | `silu_and_mul`                       | `silu_and_mul_ref`           |
| `rotary`            | `rotary_embedding` (in place)        | `rotary_embedding_ref`       |
| `paged_attention`   | `paged_decode_attention`             | `paged_decode_attention_ref` |
| `flash_attention`   | `flash_prefill`                      | `flash_prefill_ref`          |

Inside each module the plain name is the Triton kernel's launcher and `<name>_ref` the PyTorch
reference; the functions of this package pick one of the two per call. `cost` counts each kernel's
FLOPs and bytes for the roofline; `bench` times them on a GPU (`benchmarks/kernels.py`).

Where torch sees no CUDA device, Triton can only run its interpreter (`TRITON_INTERPRET=1`: every
program of the grid is run in Python with NumPy, for correctness, not speed). `@triton.jit` reads
that variable when a kernel is *defined*, i.e. when the kernel modules are imported, so it is set
here, before they are imported, unless the environment already says otherwise.
"""
from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanoserve.kernels import activation, flash_attention, norm, paged_attention, rotary, row_softmax  # noqa: E402
from nanoserve.kernels._triton import HAVE_TRITON  # noqa: E402

BACKENDS = ("auto", "torch", "triton")


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (on the CPU) instead of compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend() -> str:
    """"triton" or "torch": `NANOSERVE_KERNELS` (auto | torch | triton), auto meaning triton when CUDA is present.

    Forcing "triton" on a CPU runs the kernels in Triton's interpreter: slow, but the same code.
    """
    choice = os.environ.get("NANOSERVE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"NANOSERVE_KERNELS={os.environ['NANOSERVE_KERNELS']!r} is not valid: "
                         f"expected one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if HAVE_TRITON and _cuda_available() else "torch"
    if choice == "triton" and not HAVE_TRITON:
        raise RuntimeError("NANOSERVE_KERNELS=triton but Triton is not installed on this machine")
    return choice


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor `x` should run the Triton kernel (else the PyTorch reference)."""
    if backend() != "triton":
        return False
    if x.device.type == "cuda" or interpreting():
        return True
    if os.environ.get("NANOSERVE_KERNELS", "auto").strip().lower() == "auto":
        return False  # auto on a GPU machine with this tensor on the CPU: the reference is the right tool
    raise RuntimeError(f"NANOSERVE_KERNELS=triton but the tensor is on {x.device} and Triton compiles for CUDA "
                       "here; set TRITON_INTERPRET=1 before importing nanoserve to run the kernels on the CPU")


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor."""
    return (row_softmax.softmax if use_triton(x) else row_softmax.softmax_ref)(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension (statistics in fp32)."""
    return (norm.rms_norm if use_triton(x) else norm.rms_norm_ref)(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual) in one pass over memory."""
    return (norm.fused_add_rms_norm if use_triton(x) else norm.fused_add_rms_norm_ref)(x, residual, weight, eps)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, SwiGLU's gate."""
    return (activation.silu_and_mul if use_triton(gate) else activation.silu_and_mul_ref)(gate, up)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [..., heads, d] and k [..., kv_heads, d] in place by cos/sin [..., d]; returns (q, k)."""
    return (rotary.rotary_embedding if use_triton(q) else rotary.rotary_embedding_ref)(q, k, cos, sin)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None):
    """One decode query per sequence attending to its keys in the paged cache (see `paged_attention`)."""
    fn = paged_attention.paged_decode_attention if use_triton(q) else paged_attention.paged_decode_attention_ref
    return fn(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)


def flash_prefill(q, k, v, q_offset, scale, sliding_window=None):
    """Causal attention of Tq new queries over Tk = q_offset + Tq keys (see `flash_attention`)."""
    fn = flash_attention.flash_prefill if use_triton(q) else flash_attention.flash_prefill_ref
    return fn(q, k, v, q_offset, scale, sliding_window)


__all__ = ["backend", "use_triton", "interpreting", "HAVE_TRITON", "softmax", "rms_norm", "fused_add_rms_norm",
           "silu_and_mul", "rotary_embedding", "paged_decode_attention", "flash_prefill"]
