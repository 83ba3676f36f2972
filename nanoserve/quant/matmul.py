"""Weight-only quantized matmul, y = x W^T (+ b), with W read in 8 or 4 bits and dequantised in registers.

Decoding multiplies a few activation rows (M = 1..64) by every weight, once per token: the time goes
into reading W from memory, not into the FLOPs. A bf16 weight costs 2 bytes; int8 costs 1 byte (+ one
fp32 scale per row), int4 0.5 byte (+ a scale and a min per group), so the same matmul reads 2x or
~3.5x fewer bytes and, being memory-bound, runs up to that much faster. The kernels never write the
dequantised W to memory: each tile is turned back into floats in registers, right before `tl.dot`.

Formats (nanoserve.quant.formats): int8 q [N, K] with fp32 scales [N], W ~ q * scales[:, None];
int4 packed uint8 [N, Kp / 2] (column 2j in the low nibble of byte j, 2j + 1 in the high one), fp32
scales and mins [N, Kp / G], W[n, k] ~ mins[n, k // G] + code * scales[n, k // G], Kp = K rounded up
to a whole number of groups. Sums are in fp32; the output has x's dtype.

Two kernels per format, chosen by the number of rows M. Up to GEMV_ROWS (decode at a small batch) a GEMV kernel:
no `tl.dot`, whose smallest tile is 16 rows (15 of 16 would be padding at batch 1); each program multiplies its
BLOCK_N weight rows by the few x rows with elementwise products summed along K, and where N / BLOCK_N programs are
too few to keep a GPU's memory busy, K is split over several programs (split-K), whose fp32 partial sums one
`sum` adds. Above GEMV_ROWS (prefill, large batches) the tile kernel on tensor cores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.device import sm_count
from nanoserve.kernels._triton import tl, triton
from nanoserve.quant.formats import INT4_GROUP_SIZES, dequantize_int4, dequantize_int8, padded_in, unpack_int4
from nanoserve.validation import check_int

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GEMV_ROWS = 4             # up to this many rows of x take the GEMV kernels
GEMV_ELEMENTS = 4096      # a GEMV program's product tile, BLOCK_M x BLOCK_N x (its K step): registers, not more
PROGRAMS_PER_SM = 8       # split-K until a GPU holds this many programs per SM (or K runs out of steps)


@triton.jit
def _int8_matmul_kernel(x_ptr, q_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K,
                        stride_xm, stride_qn, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # one program: BLOCK_M rows of x times BLOCK_N output channels; rows >= M are masked (decode has M = 1,
    # but tl.dot needs tiles of at least 16: the idle rows cost FLOPs, not bytes, and bytes are the limit)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # the weight tile, loaded already transposed ([K, N]): 1 byte per weight crosses the memory bus
        q = tl.load(q_ptr + n[None, :] * stride_qn + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        if UPCAST:  # Triton's interpreter cannot multiply (or make) bf16 numbers: give its tl.dot fp32
            x, w = x.to(tl.float32), q.to(tl.float32)
        else:       # codes -127..127 are exact in bf16/fp16 (8+ significant bits): x's dtype loses nothing
            w = q.to(x_ptr.dtype.element_ty)
        acc += tl.dot(x, w, input_precision=PRECISION)
    # the scale is per output channel, constant along K: apply it once to the sum instead of per weight
    acc *= tl.load(scales_ptr + n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_matmul_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, K, n_groups,
                        stride_xm, stride_pn, stride_om,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    j = tl.arange(0, GROUP // 2)        # byte j of a group holds its columns 2j (low) and 2j + 1 (high)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # BLOCK_K == one group (32..256 columns): each row of the tile then has one scale and one min, loaded
    # as [BLOCK_N] vectors, instead of a [BLOCK_K, BLOCK_N] gather through per-column group indices.
    # The packed rows hold whole groups (n_groups = Kp / G), so only x needs a mask along K.
    for g in range(0, n_groups):
        b = tl.load(packed_ptr + n[None, :] * stride_pn + g * (GROUP // 2) + j[:, None],
                    mask=n_mask[None, :], other=0)                                     # [G/2, N] uint8
        scale = tl.load(scales_ptr + n * n_groups + g, mask=n_mask, other=0.0)[None, :]
        lo = tl.load(mins_ptr + n * n_groups + g, mask=n_mask, other=0.0)[None, :]
        # dequantise in fp32, round to x's dtype as the reference does (it dequantises W to x.dtype)
        w_even = (lo + (b & 0xF).to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
        w_odd = (lo + (b >> 4).to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
        # instead of interleaving the nibbles back into column order, split x the same way: even
        # columns meet the low nibbles, odd columns the high ones. Columns >= K (the padding) read 0.
        k_even = g * GROUP + 2 * j
        x_even = tl.load(x_ptr + m[:, None] * stride_xm + k_even[None, :],
                         mask=m_mask[:, None] & (k_even[None, :] < K), other=0.0)      # [M, G/2]
        x_odd = tl.load(x_ptr + m[:, None] * stride_xm + k_even[None, :] + 1,
                        mask=m_mask[:, None] & (k_even[None, :] + 1 < K), other=0.0)
        if UPCAST:  # the interpreter's bf16 arithmetic is broken: multiply in fp32 (exact for bf16 inputs)
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            w_even, w_odd = w_even.to(tl.float32), w_odd.to(tl.float32)
        acc += tl.dot(x_even, w_even, input_precision=PRECISION)
        acc += tl.dot(x_odd, w_odd, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int8_gemv_kernel(x_ptr, q_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                      stride_xm, stride_qn, stride_om,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # one program: BLOCK_N output channels of the M (<= BLOCK_M) rows, over one stretch of K (all of it unless SPLIT)
    m, n, split, m_mask, n_mask = _gemv_program(M, N, BLOCK_M, BLOCK_N)
    k_end = tl.minimum(split * k_per_split + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(split * k_per_split, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        w = tl.load(q_ptr + n[:, None] * stride_qn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0).to(tl.float32)                                                    # [N, K] codes
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)                                                  # [M, K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    acc *= tl.load(scales_ptr + n, mask=n_mask, other=0.0)[None, :]
    _gemv_store(acc, bias_ptr, out_ptr, m, n, split, M, N, stride_om, HAS_BIAS, SPLIT)


@triton.jit
def _int4_gemv_kernel(x_ptr, packed_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, K, n_groups,
                      groups_per_split, stride_xm, stride_pn, stride_om,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # as _int8_gemv_kernel, one group of K per step; the nibbles split x into even and odd columns, as in
    # _int4_matmul_kernel, and the weights are rounded to x's dtype as the reference rounds them
    m, n, split, m_mask, n_mask = _gemv_program(M, N, BLOCK_M, BLOCK_N)
    j = tl.arange(0, GROUP // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(split * groups_per_split, tl.minimum(split * groups_per_split + groups_per_split, n_groups)):
        b = tl.load(packed_ptr + n[:, None] * stride_pn + g * (GROUP // 2) + j[None, :],
                    mask=n_mask[:, None], other=0)                                             # [N, G/2] uint8
        scale = tl.load(scales_ptr + n * n_groups + g, mask=n_mask, other=0.0)[:, None]
        lo = tl.load(mins_ptr + n * n_groups + g, mask=n_mask, other=0.0)[:, None]
        w_even = (lo + (b & 0xF).to(tl.float32) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        w_odd = (lo + (b >> 4).to(tl.float32) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        k_even = g * GROUP + 2 * j
        x_even = tl.load(x_ptr + m[:, None] * stride_xm + k_even[None, :],
                         mask=m_mask[:, None] & (k_even[None, :] < K), other=0.0).to(tl.float32)   # [M, G/2]
        x_odd = tl.load(x_ptr + m[:, None] * stride_xm + k_even[None, :] + 1,
                        mask=m_mask[:, None] & (k_even[None, :] + 1 < K), other=0.0).to(tl.float32)
        acc += tl.sum(x_even[:, None, :] * w_even[None, :, :], axis=2)
        acc += tl.sum(x_odd[:, None, :] * w_odd[None, :, :], axis=2)
    _gemv_store(acc, bias_ptr, out_ptr, m, n, split, M, N, stride_om, HAS_BIAS, SPLIT)


@triton.jit
def _gemv_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMV program's rows of x, its output channels, its stretch of K, and the masks of the first two."""
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, n, tl.program_id(1), m < M, n < N


@triton.jit
def _gemv_store(acc, bias_ptr, out_ptr, m, n, split, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    mask = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT:   # a partial sum, fp32 [splits, M, N]: the launcher adds them up (and the bias)
        tl.store(out_ptr + (split * M + m[:, None]) * N + n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, mask=mask)


# --- launchers ----------------------------------------------------------------------------------

def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int = 32, block_k: int = 128, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight int8 [N, K] * scales fp32 [N])^T (+ bias [N]) -> [..., N] in x's dtype.

    Up to GEMV_ROWS rows: the GEMV kernel, K split over `split_k` programs (None: as many as the GPU needs, 1 off
    it). More rows: the tile kernel, block_n x block_k the weight tile a program reads per step.
    """
    _check_int8(x, qweight, scales, bias)
    _check_contiguous("int8_matmul", qweight=qweight, scales=scales, bias=bias)
    x2, lead = _rows(x)
    N, K = qweight.shape
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    if out.numel() and x2.shape[0] <= GEMV_ROWS:
        block_m = triton.next_power_of_2(x2.shape[0])
        block_n = _gemv_block_n(block_m, 128)
        splits = _gemv_splits(split_k, triton.cdiv(N, block_n), triton.cdiv(K, 128), x.device)
        per_split = triton.cdiv(triton.cdiv(K, 128), splits) * 128
        target = out if splits == 1 else torch.empty(splits, x2.shape[0], N, dtype=torch.float32, device=x.device)
        _int8_gemv_kernel[(triton.cdiv(N, block_n), splits)](
            x2, qweight, scales, bias if bias is not None else scales, target, x2.shape[0], N, K, per_split,
            x2.stride(0), qweight.stride(0), out.stride(0), HAS_BIAS=bias is not None, SPLIT=splits > 1,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128)
        _add_partials(target, out, bias)
    elif out.numel():
        block_m, precision, upcast = _tiles(x2)
        grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(N, block_n))
        _int8_matmul_kernel[grid](
            x2, qweight, scales, bias if bias is not None else scales, out, x2.shape[0], N, K,
            x2.stride(0), qweight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast)
    return out.reshape(*lead, N)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, block_n: int = 32, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias [N]) -> [..., N] in x's dtype, W the int4 weight (see the module docstring).

    K is x's last dimension, the true in_features; the packed rows may be longer (padded to whole groups).
    Each program steps through K one group (group_size columns) at a time. Up to GEMV_ROWS rows: the GEMV
    kernel, its groups split over `split_k` programs (None: as the GPU needs, 1 off it); more: the tile kernel.
    """
    _check_int4(x, packed, scales, mins, group_size, bias)
    _check_contiguous("int4_matmul", packed=packed, scales=scales, mins=mins, bias=bias)
    x2, lead = _rows(x)
    N, K = packed.shape[0], x.shape[-1]
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    n_groups = scales.shape[1]
    if out.numel() and x2.shape[0] <= GEMV_ROWS:
        block_m = triton.next_power_of_2(x2.shape[0])
        block_n = _gemv_block_n(block_m, group_size // 2)
        splits = _gemv_splits(split_k, triton.cdiv(N, block_n), n_groups, x.device)
        target = out if splits == 1 else torch.empty(splits, x2.shape[0], N, dtype=torch.float32, device=x.device)
        _int4_gemv_kernel[(triton.cdiv(N, block_n), splits)](
            x2, packed, scales, mins, bias if bias is not None else scales, target, x2.shape[0], N, K, n_groups,
            triton.cdiv(n_groups, splits), x2.stride(0), packed.stride(0), out.stride(0), GROUP=group_size,
            HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n)
        _add_partials(target, out, bias)
    elif out.numel():
        block_m, precision, upcast = _tiles(x2)
        grid = (triton.cdiv(x2.shape[0], block_m), triton.cdiv(N, block_n))
        _int4_matmul_kernel[grid](
            x2, packed, scales, mins, bias if bias is not None else scales, out, x2.shape[0], N, K, scales.shape[1],
            x2.stride(0), packed.stride(0), out.stride(0), GROUP=group_size, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, UPCAST=upcast)
    return out.reshape(*lead, N)


def _gemv_block_n(block_m: int, k_step: int) -> int:
    """Output channels per GEMV program: as many as keep its product tile within GEMV_ELEMENTS, 8 to 64."""
    return min(64, max(8, GEMV_ELEMENTS // (block_m * k_step)))


def _gemv_splits(split_k: int | None, n_programs: int, k_steps: int, device: torch.device) -> int:
    """How many programs share K: `split_k` as asked (at most one K step each), else enough for PROGRAMS_PER_SM
    programs per SM on a GPU, each with two K steps at least; 1 off the GPU."""
    if split_k is not None:
        check_int("split_k", split_k)
        return min(split_k, k_steps)
    if device.type != "cuda":
        return 1
    return max(1, min(-(-PROGRAMS_PER_SM * sm_count(device) // n_programs), k_steps // 2))


def _add_partials(target: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Split-K: out = the partial sums' total (+ bias), in out's dtype. Without a split the kernel wrote out."""
    if target is out:
        return
    total = target.sum(0)
    out.copy_(total if bias is None else total + bias.float())


def _rows(x):
    """x as an [M, K] matrix with unit column stride (a view where possible), and the leading dims."""
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), x.shape[:-1]


def _tiles(x2):
    """(BLOCK_M, tl.dot precision, upcast) for x2 [M, K]. BLOCK_M: 16 (tl.dot's smallest) up to 64."""
    block_m = min(64, max(16, triton.next_power_of_2(x2.shape[0])))
    upcast = x2.dtype == torch.bfloat16 and x2.device.type != "cuda"   # the interpreter's bf16 arithmetic is broken
    # fp32 multiplies in full fp32 (no TF32) so it agrees with the fp32 reference; 16-bit inputs use tensor cores
    precision = "ieee" if x2.dtype == torch.float32 or upcast else "tf32"
    return block_m, precision, upcast


# --- references -------------------------------------------------------------------------------------

def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference: dequantise W to x's dtype, then F.linear."""
    _check_int8(x, qweight, scales, bias)
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)


def int4_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference: unpack, dequantise W [N, K] to x's dtype, then F.linear."""
    _check_int4(x, packed, scales, mins, group_size, bias)
    return F.linear(x, dequantize_int4(unpack_int4(packed), scales, mins, x.shape[-1], x.dtype), bias)


# --- input checks -----------------------------------------------------------------------------------

def _check_x(op, x):
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be [..., K], got a scalar")


def _check_vector(op, name, t, N, dtype, device):
    if t.shape != (N,) or t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype} [N={N}], got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {device}")


def _check_contiguous(op, **tensors):
    """The kernels index the weights as dense row-major arrays; copying them here would cost a full read
    and write of W per call, more than the matmul itself, so a strided weight is an error."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} {list(t.shape)} must be contiguous (strides {t.stride()})")


def _check_int8(x, qweight, scales, bias):
    op = "int8_matmul"
    _check_x(op, x)
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"{op}: qweight must be int8 [N, K], got {qweight.dtype} {list(qweight.shape)}")
    N, K = qweight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{op}: x's last dimension {x.shape[-1]} (x {list(x.shape)}) != K = {K} of "
                         f"qweight {list(qweight.shape)}")
    if qweight.device != x.device:
        raise ValueError(f"{op}: qweight is on {qweight.device} but x is on {x.device}")
    _check_vector(op, "scales", scales, N, torch.float32, x.device)
    if bias is not None:
        _check_vector(op, "bias", bias, N, x.dtype, x.device)


def _check_int4(x, packed, scales, mins, group_size, bias):
    op = "int4_matmul"
    _check_x(op, x)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{op}: group_size {group_size} is not supported: expected one of "
                         f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"{op}: packed must be uint8 [N, Kp / 2], got {packed.dtype} {list(packed.shape)}")
    N, width = packed.shape[0], packed.shape[1] * 2
    K = x.shape[-1]
    if width != padded_in(K, group_size):
        raise ValueError(f"{op}: packed {list(packed.shape)} holds {width} columns, but x {list(x.shape)} has "
                         f"K = {K}, which group_size {group_size} pads to {padded_in(K, group_size)} "
                         f"(packed [N, {padded_in(K, group_size) // 2}])")
    if packed.device != x.device:
        raise ValueError(f"{op}: packed is on {packed.device} but x is on {x.device}")
    for name, t in (("scales", scales), ("mins", mins)):
        if t.shape != (N, width // group_size) or t.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32 [N={N}, groups={width // group_size}] "
                             f"(packed {list(packed.shape)}, group_size {group_size}), got {t.dtype} {list(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if bias is not None:
        _check_vector(op, "bias", bias, N, x.dtype, x.device)
