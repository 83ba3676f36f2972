"""What each kernel costs: FLOPs done and bytes moved to and from memory, for the roofline.

Bytes count each tensor read or written once (the least any kernel can move: what a fused kernel
achieves); FLOPs count every add, multiply, exp and divide as one. `bytes_per_element` is the size of
the activations (2 for bf16/fp16, 4 for fp32); rotary's cos/sin tables are fp32.

`WORKLOAD` is one step of a Llama-3-8B-shaped model (the shapes the chapter and the benchmark use);
`workload_costs()` lists every kernel's cost on it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelCost:
    """One kernel call: its name, the shape it works on, FLOPs and bytes moved."""

    kernel: str
    shape: str
    flops: float
    bytes: float
    compute: str = "fp32"   # the peak that applies: "fp32" (CUDA cores) or "bf16" (tensor-core matmuls)

    @property
    def intensity(self) -> float:
        """FLOP per byte."""
        return self.flops / self.bytes


def softmax_cost(rows: int, cols: int, bytes_per_element: int = 2) -> KernelCost:
    # per element: compare for the max, subtract, exp, add to the sum, divide
    return KernelCost("softmax", f"[{rows}, {cols}]", 5 * rows * cols, 2 * rows * cols * bytes_per_element)


def rms_norm_cost(tokens: int, hidden: int, bytes_per_element: int = 2, fused_add: bool = False) -> KernelCost:
    n = tokens * hidden
    # square, add to the sum, scale, weight (+ the residual add); read x (+ residual), write out (+ new residual)
    flops = (5 if fused_add else 4) * n
    moved = ((4 if fused_add else 2) * n + hidden) * bytes_per_element
    name = "fused_add_rms_norm" if fused_add else "rms_norm"
    return KernelCost(name, f"[{tokens}, {hidden}]", flops, moved)


def silu_and_mul_cost(tokens: int, intermediate: int, bytes_per_element: int = 2) -> KernelCost:
    n = tokens * intermediate
    # negate, exp, add 1, divide, multiply by up; read gate and up, write the product
    return KernelCost("silu_and_mul", f"[{tokens}, {intermediate}]", 5 * n, 3 * n * bytes_per_element)


def rotary_cost(tokens: int, heads: int, kv_heads: int, head_dim: int, bytes_per_element: int = 2) -> KernelCost:
    n = tokens * (heads + kv_heads) * head_dim
    # per element two multiplies and an add; q and k read and written in place, cos/sin (fp32, half each) read
    moved = 2 * n * bytes_per_element + 2 * tokens * (head_dim // 2) * 4
    return KernelCost("rotary_embedding", f"{tokens} tokens x ({heads}+{kv_heads}) heads x {head_dim}", 3 * n, moved)


def paged_decode_cost(batch: int, heads: int, kv_heads: int, head_dim: int, context: int, block_size: int = 16,
                      bytes_per_element: int = 2) -> KernelCost:
    # per query head and key: q.k (2d) and p*v (2d), plus the softmax's few per score
    flops = batch * heads * context * (4 * head_dim + 5)
    kv = 2 * batch * context * kv_heads * head_dim * bytes_per_element   # each kv head's keys read once (GQA)
    qo = 2 * batch * heads * head_dim * bytes_per_element
    tables = batch * (context // block_size + 1) * 4 + batch * 4
    return KernelCost("paged_decode_attention", f"{batch} seqs x {context} keys, {heads}/{kv_heads} heads x {head_dim}",
                      flops, kv + qo + tables, compute="fp32")


def prefill_pairs(q_len: int, q_offset: int = 0) -> int:
    """Causal (query, key) pairs: query i at position q_offset + i sees q_offset + i + 1 keys."""
    return q_len * q_offset + q_len * (q_len + 1) // 2


def flash_prefill_cost(heads: int, kv_heads: int, head_dim: int, q_len: int, q_offset: int = 0,
                       bytes_per_element: int = 2) -> KernelCost:
    pairs = prefill_pairs(q_len, q_offset)
    flops = heads * pairs * (4 * head_dim + 5)                              # two matmuls on tensor cores
    moved = (2 * heads * q_len + 2 * kv_heads * (q_offset + q_len)) * head_dim * bytes_per_element
    return KernelCost("flash_prefill", f"{q_len} queries after {q_offset}, {heads}/{kv_heads} heads x {head_dim}",
                      flops, moved, compute="bf16")


def naive_prefill_cost(heads: int, kv_heads: int, head_dim: int, q_len: int, q_offset: int = 0,
                       bytes_per_element: int = 2) -> KernelCost:
    """Unfused attention: the [q_len, keys] score matrix is written, read by softmax, written, read again."""
    fl = flash_prefill_cost(heads, kv_heads, head_dim, q_len, q_offset, bytes_per_element)
    scores = heads * q_len * (q_offset + q_len) * bytes_per_element
    return KernelCost("attention, unfused", fl.shape, fl.flops, fl.bytes + 4 * scores, compute="bf16")


# Llama-3-8B: hidden 4096, MLP 14336, 32 query heads sharing 8 kv heads of 128
WORKLOAD = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                tokens=4096,            # a step's batched tokens (elementwise kernels)
                batch=64, context=2048,  # decode attention: 64 sequences with 2048 cached tokens each
                prompt=2048)             # prefill attention: one 2048-token prompt


def workload_costs(w: dict = WORKLOAD, bytes_per_element: int = 2) -> list[KernelCost]:
    """Every kernel of the chapter on the shapes of `w` (default: one Llama-3-8B step in bf16)."""
    b = bytes_per_element
    return [
        softmax_cost(w["heads"] * w["batch"], w["context"], b),
        rms_norm_cost(w["tokens"], w["hidden"], b),
        rms_norm_cost(w["tokens"], w["hidden"], b, fused_add=True),
        silu_and_mul_cost(w["tokens"], w["intermediate"], b),
        rotary_cost(w["tokens"], w["heads"], w["kv_heads"], w["head_dim"], b),
        paged_decode_cost(w["batch"], w["heads"], w["kv_heads"], w["head_dim"], w["context"], bytes_per_element=b),
        flash_prefill_cost(w["heads"], w["kv_heads"], w["head_dim"], w["prompt"], bytes_per_element=b),
    ]
