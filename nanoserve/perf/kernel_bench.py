"""Timing the kernels on a GPU: the chapter 05 notebook and `benchmarks/kernels.py` share this.

`measure()` runs each kernel and its PyTorch reference on one Llama-3-8B-shaped step
(`cost.WORKLOAD`, bf16), timed by `triton.testing.do_bench` (median, CUDA events, L2 flushed between
runs), and reports the achieved bandwidth (the kernel's minimum bytes over its time) against the GPU's
datasheet row in `nanoserve.perf.HARDWARE` and the roofline's predicted time. CUDA only.
"""
from __future__ import annotations

import math
import re

import torch

from nanoserve.device import sm_count
from nanoserve.kernels import activation, flash_attention, norm, paged_attention, rotary, row_softmax
from nanoserve.perf import kernel_cost as cost
from nanoserve.perf.hardware import HARDWARE, Hardware, measure_ceilings
from nanoserve.perf.roofline import roofline


def hardware_row() -> Hardware:
    """This GPU's datasheet row (matched by name), else its measured ceilings."""
    name = torch.cuda.get_device_name()
    for row in HARDWARE.values():
        key = row.name.replace(" 80GB", "").replace(" SXM", "")     # "H100 SXM" -> H100, "RTX 4090" stays
        if re.search(rf"\b{re.escape(key)}\b", name):              # L4 must not match an L40S
            return row
    return measure_ceilings()


def workload_inputs(w: dict = cost.WORKLOAD, dtype=torch.bfloat16, dev="cuda"):
    """(module, op name, args) of each kernel, in the order of `cost.workload_costs(w)`."""
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    T, Hd, I = w["tokens"], w["hidden"], w["intermediate"]
    H, Hk, D = w["heads"], w["kv_heads"], w["head_dim"]
    B, ctx, block = w["batch"], w["context"], 16
    pos = torch.arange(T, device=dev).float()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    per_seq = math.ceil(ctx / block)
    num_blocks = B * per_seq + 64
    tables = torch.randperm(num_blocks, device=dev)[: B * per_seq].view(B, per_seq).int()   # blocks scattered
    return [
        (row_softmax, "softmax", (r(H * B, ctx),)),
        (norm, "rms_norm", (r(T, Hd), r(Hd), 1e-5)),
        (norm, "fused_add_rms_norm", (r(T, Hd), r(T, Hd), r(Hd), 1e-5)),
        (activation, "silu_and_mul", (r(T, I), r(T, I))),
        (rotary, "rotary_embedding", (r(T, H, D), r(T, Hk, D), emb.cos(), emb.sin())),
        (paged_attention, "paged_decode_attention",
         (r(B, H, D), r(num_blocks, block, Hk, D), r(num_blocks, block, Hk, D), tables,
          torch.full((B,), ctx, dtype=torch.int32, device=dev), D ** -0.5)),
        (flash_attention, "flash_prefill",
         (r(H, w["prompt"], D), r(Hk, w["prompt"], D), r(Hk, w["prompt"], D), 0, D ** -0.5)),
    ]


def measure(w: dict = cost.WORKLOAD, with_reference: bool = True) -> list[dict]:
    """Time every kernel (and its reference) on the workload; one dict per kernel, times in seconds."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel timings need a CUDA GPU: in Triton's interpreter they mean nothing")
    import triton.testing

    hw = hardware_row()
    rows = []
    for (module, name, args), c in zip(workload_inputs(w), cost.workload_costs(w)):
        kernel, ref = getattr(module, name), getattr(module, name + "_ref")
        # rotary works in place: rotating the same tensors again costs the same
        t_kernel = triton.testing.do_bench(lambda: kernel(*args), return_mode="median") * 1e-3
        t_ref = triton.testing.do_bench(lambda: ref(*args), return_mode="median") * 1e-3 if with_reference else None
        pred = roofline(c.flops, c.bytes, hw, c.compute)
        row = dict(kernel=name, shape=c.shape, flops=c.flops, bytes=c.bytes, bound=pred.bound,
                   hardware=hw.name, predicted_s=pred.predicted_s, triton_s=t_kernel, torch_s=t_ref,
                   achieved_bytes_per_s=c.bytes / t_kernel, fraction_of_peak_bw=c.bytes / t_kernel / hw.mem_bw)
        if name == "paged_decode_attention":   # split-KV as chosen, beside one program per (sequence, kv head)
            q, tables = args[0], args[3]
            row["num_splits"] = paged_attention.decode_splits(q.shape[0], args[1].shape[2], tables.shape[1],
                                                              sm_count(q.device))
            row["one_split_s"] = triton.testing.do_bench(lambda: kernel(*args, num_splits=1), return_mode="median") * 1e-3
        rows.append(row)
    return rows
