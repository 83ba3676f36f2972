"""Chapter 05: kernels for the memory-bound parts of a decoder, each beside its PyTorch reference.

    from nanoserve import kernels
    ops = kernels.select()                  # once per engine: NANOSERVE_KERNELS=auto|torch|cpu|triton
    out = ops.silu_and_mul(gate, up)        # the chosen implementation, no per-call decision

| module              | op                                   | reference                    |
| ------------------- | ------------------------------------ | ---------------------------- |
| `row_softmax`       | `softmax` (the teaching kernel)      | `softmax_ref`                |
| `norm`              | `rms_norm`, `fused_add_rms_norm`     | `rms_norm_ref`, ...`_ref`    |
| `activation`        | `silu_and_mul`                       | `silu_and_mul_ref`           |
| `rotary`            | `rotary_embedding` (in place)        | `rotary_embedding_ref`       |
| `paged_attention`   | `paged_decode_attention` (Triton)    | `paged_decode_attention_ref` |
| `cpu_attention`     | `paged_attention` (C, on the CPU)    | `paged_decode_attention_ref` |
| `flash_attention`   | `flash_prefill`                      | `flash_prefill_ref`          |

Inside each module the plain name is the kernel's launcher and `<name>_ref` the PyTorch reference.
`select()` returns a `KernelSet`: the functions of one backend that a model calls (not the teaching
softmax: no layer calls it), bound once. The backends:

- "torch": every op is its PyTorch reference (paged attention gathers the blocks it reads);
- "cpu": the references, except decode attention, which is the C kernel that reads the blocks in place;
- "triton": the Triton kernels (compiled on a GPU; on a CPU, run by Triton's interpreter: slow, exact).

`auto` means triton on CUDA, cpu elsewhere (torch where no C compiler is found). The measuring lives in
`nanoserve.perf`: `kernel_cost` counts each kernel's FLOPs and bytes for the roofline, `kernel_bench` times
them on a GPU (`benchmarks/kernels.py`).

Where torch sees no CUDA device, Triton can only run its interpreter. `@triton.jit` decides between
compiling and interpreting when a kernel is *defined*, and the interpreter checks again at launch,
from Triton's `interpret` setting: `_triton` sets it when it imports Triton, leaving the process
environment as it was.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from nanoserve.kernels import activation, cpu_attention, flash_attention, norm, paged_attention, rotary
from nanoserve.kernels._triton import HAVE_TRITON

BACKENDS = ("auto", "torch", "cpu", "triton")


def interpreting() -> bool:
    """True when the Triton kernels were defined for the interpreter (no CUDA) instead of a GPU."""
    return HAVE_TRITON and type(norm._rms_norm_kernel).__name__ == "InterpretedFunction"


def backend(choice: str | None = None, device: torch.device | str | None = None) -> str:
    """"torch", "cpu" or "triton", from `choice` or else `NANOSERVE_KERNELS` (auto | torch | cpu | triton),
    for a model on `device` (default: cuda when present, else cpu).

    auto: triton for a model on CUDA; on the CPU, cpu when the C kernel builds here, else torch.
    Forcing "triton" on a CPU runs the kernels in Triton's interpreter: slow, but the same code.
    """
    source = "backend" if choice is not None else "NANOSERVE_KERNELS"
    name = (choice if choice is not None else os.environ.get("NANOSERVE_KERNELS", "auto")).strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not valid: expected one of {', '.join(BACKENDS)}")
    on = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "auto":
        if on == "cuda":
            return "triton" if HAVE_TRITON else "torch"
        return "cpu" if cpu_attention.available() else "torch"
    if name == "triton" and not HAVE_TRITON:
        raise RuntimeError(f"{source}=triton but Triton is not installed on this machine")
    if name == "triton" and on == "cpu" and not interpreting():
        raise RuntimeError(f"{source}=triton for a model on the CPU: this machine has CUDA, so the kernels were "
                           "compiled for the GPU; use the torch or cpu backend, or run the model on cuda")
    if name == "cpu" and on != "cpu":
        raise RuntimeError(f"{source}=cpu (the C kernel) for a model on {on}: it reads CPU memory only")
    if name == "cpu" and not cpu_attention.available():
        raise RuntimeError(f"{source}=cpu but the C kernel cannot be built: {cpu_attention.unavailable_reason()}")
    return name


@dataclass(frozen=True)
class KernelSet:
    """The ops of one backend. A model and its attention layer call these and nothing else."""
    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    rotary_embedding: Callable           # in place on q and k; returns (q, k)
    paged_decode_attention: Callable     # (q, k_cache, v_cache, block_tables, context_lens, scale, window)
    flash_prefill: Callable              # (q, k, v, q_offset, scale, window)
    decode_in_place: bool = False        # decode attention reads the KV blocks where they are (the reference
                                         # gathers them, and reads each sequence's length on the host)
    own_prefill: bool = False            # prefill attention runs flash_prefill (else torch's SDPA, which the
                                         # reference's flash_prefill_ref only restates)


def _reference_ops() -> dict:
    return dict(rms_norm=norm.rms_norm_ref, fused_add_rms_norm=norm.fused_add_rms_norm_ref,
                silu_and_mul=activation.silu_and_mul_ref, rotary_embedding=rotary.rotary_embedding_ref,
                paged_decode_attention=paged_attention.paged_decode_attention_ref,
                flash_prefill=flash_attention.flash_prefill_ref)


def _triton_ops() -> dict:
    return dict(rms_norm=norm.rms_norm, fused_add_rms_norm=norm.fused_add_rms_norm,
                silu_and_mul=activation.silu_and_mul, rotary_embedding=rotary.rotary_embedding,
                paged_decode_attention=paged_attention.paged_decode_attention,
                flash_prefill=flash_attention.flash_prefill)


def select(choice: str | None = None, device: torch.device | str | None = None) -> KernelSet:
    """The KernelSet for `choice` (or NANOSERVE_KERNELS) and a model on `device`. Called once, by whoever
    builds the engine; see `backend` for how auto chooses."""
    name = backend(choice, device)
    if name == "triton":
        return KernelSet("triton", **_triton_ops(), decode_in_place=True, own_prefill=True)
    if name == "cpu":   # the references, with decode attention reading the KV blocks in place
        return KernelSet("cpu", **(_reference_ops() | dict(paged_decode_attention=cpu_attention.paged_attention)),
                         decode_in_place=True)
    return KernelSet("torch", **_reference_ops())


REFERENCE = KernelSet("torch", **_reference_ops())   # what a model uses until an engine selects its backend

__all__ = ["backend", "select", "KernelSet", "REFERENCE", "interpreting", "HAVE_TRITON", "BACKENDS"]
