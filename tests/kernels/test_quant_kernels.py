"""Weight-only quantized matmul kernels (nanoserve.quant.matmul) against their PyTorch references.

On a machine without CUDA the Triton kernels run in Triton's interpreter, so shapes stay small; the
`gpu` tests run the compiled kernels at the course model's MLP shapes.

Tolerances are relative to the largest |output| (a matmul's small outputs are sums that cancelled, so
their error is set by the size of the terms, not of the result):
- fp32: the kernel applies the int8 scale once to the sum instead of to each weight, and sums in
  another order: a few ulps of fp32, 1e-4 leaves room.
- bf16: both sides round W (int4) and the output to bf16, each one ulp (2^-8..2^-7) off at worst; the
  interpreter rounds fp32 -> bf16 toward zero where PyTorch rounds to nearest: 1e-2.
- fp16: three more bits than bf16: 2e-3.
A packing or masking bug (wrong nibble, wrong group, padding read) gives errors of order 1, far above.
"""
from __future__ import annotations

import pytest
import torch

from nanoserve.quant import matmul as qm
from nanoserve.quant import formats

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEV)


def assert_matches(got, expected, dtype, what):
    assert got.dtype == dtype and got.shape == expected.shape, f"{what}: {got.dtype} {list(got.shape)} vs " \
                                                              f"{expected.dtype} {list(expected.shape)}"
    tol = TOL[dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * scale, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


def int8_weight(n, k, seed):
    q, scales = formats.quantize_int8(randn(n, k, seed=seed, scale=0.05).cpu())
    return q.to(DEV), scales.to(DEV)


def int4_weight(n, k, group_size, seed):
    codes, scales, mins = formats.quantize_int4(randn(n, k, seed=seed, scale=0.05).cpu(), group_size)
    return formats.pack_int4(codes).to(DEV), scales.to(DEV), mins.to(DEV)


# --- kernel against reference --------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_kernel_matches_reference(m, dtype, bias):
    # N = 80: three N tiles of 32, the last partial; K = 200: a full and a partial K tile of 128
    q, scales = int8_weight(80, 200, seed=1)
    x = randn(m, 200, dtype=dtype, seed=2)
    b = randn(80, dtype=dtype, seed=3) if bias else None
    assert_matches(qm.int8_matmul(x, q, scales, b), qm.int8_matmul_ref(x, q, scales, b), dtype, "int8_matmul")


# (group_size, K): every group size; K padded to whole groups (201: odd, its last column a low nibble),
# and one K that needs no padding
INT4_CASES = [(32, 201), (64, 200), (128, 256), (256, 300)]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("group_size,k", INT4_CASES, ids=[f"G{g}-K{k}" for g, k in INT4_CASES])
def test_int4_kernel_matches_reference(group_size, k, m, dtype, bias):
    packed, scales, mins = int4_weight(72, k, group_size, seed=4)
    x = randn(m, k, dtype=dtype, seed=5)
    b = randn(72, dtype=dtype, seed=6) if bias else None
    assert_matches(qm.int4_matmul(x, packed, scales, mins, group_size, b),
                   qm.int4_matmul_ref(x, packed, scales, mins, group_size, b), dtype, "int4_matmul")


# split-K: the GEMV kernels (up to GEMV_ROWS rows) with K shared by several programs, whose partial sums are added
# (the bias with them, on the host; without a split the kernel adds it). K = 520 is five K steps of 128, the last
# partial, so 3 splits leave one program a single step and 8 are capped at five
F32, BF16 = torch.float32, torch.bfloat16
INT8_SPLITS = [(split, m, F32, False) for split in (1, 3, 8) for m in (1, qm.GEMV_ROWS)] + \
              [(1, 1, BF16, True), (3, 2, BF16, True), (8, qm.GEMV_ROWS, F32, True)]


@pytest.mark.parametrize("split_k,m,dtype,bias", INT8_SPLITS, ids=[f"s{s}-m{m}-{str(d)[6:]}-{'bias' if b else 'nobias'}"
                                                                   for s, m, d, b in INT8_SPLITS])
def test_int8_gemv_split_k_matches_reference(split_k, m, dtype, bias):
    q, scales = int8_weight(72, 520, seed=40)
    x = randn(m, 520, dtype=dtype, seed=41)
    b = randn(72, dtype=dtype, seed=42) if bias else None
    assert_matches(qm.int8_matmul(x, q, scales, b, split_k=split_k), qm.int8_matmul_ref(x, q, scales, b), dtype,
                   f"int8_matmul split_k={split_k}")


INT4_SPLITS = [(g, k, split, 1, F32, False) for g, k in ((32, 201), (128, 300)) for split in (2, 3, 16)] + \
              [(32, 201, 3, qm.GEMV_ROWS, BF16, True), (128, 300, 1, qm.GEMV_ROWS, BF16, True)]


@pytest.mark.parametrize("group_size,k,split_k,m,dtype,bias", INT4_SPLITS,
                         ids=[f"G{g}-K{k}-s{s}-m{m}-{str(d)[6:]}-{'bias' if b else 'nobias'}"
                              for g, k, s, m, d, b in INT4_SPLITS])
def test_int4_gemv_split_k_matches_reference(group_size, k, split_k, m, dtype, bias):
    packed, scales, mins = int4_weight(40, k, group_size, seed=43)
    x = randn(m, k, dtype=dtype, seed=44)
    b = randn(40, dtype=dtype, seed=45) if bias else None
    assert_matches(qm.int4_matmul(x, packed, scales, mins, group_size, b, split_k=split_k),
                   qm.int4_matmul_ref(x, packed, scales, mins, group_size, b), dtype, f"int4_matmul split_k={split_k}")


def test_gemv_split_policy_and_bad_split_k(monkeypatch):
    """Off the GPU one program per N tile; on one, K is split until PROGRAMS_PER_SM programs per SM (each with two K
    steps at least); an asked split is capped at one K step per program. A bad split_k names itself."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert qm._gemv_splits(None, 4, 40, cpu) == 1
    assert qm._gemv_splits(3, 4, 40, cpu) == 3 and qm._gemv_splits(99, 4, 5, cpu) == 5
    monkeypatch.setattr(qm, "sm_count", lambda dev: 132)    # an H100 or H200
    assert qm._gemv_splits(None, 28, 7, gpu) == 3          # Qwen2.5-0.5B's o_proj at batch 1: 28 N tiles, 7 steps
    assert qm._gemv_splits(None, 64, 32, gpu) == 16        # 1056 wanted / 64 tiles = 17, two steps each: 16
    assert qm._gemv_splits(None, 2048, 32, gpu) == 1
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="split_k"):
            qm.int8_matmul(randn(1, 64, seed=46), *int8_weight(16, 64, seed=47), split_k=bad)


@pytest.mark.parametrize("m", [qm.GEMV_ROWS, qm.GEMV_ROWS + 1])
def test_gemv_and_tile_kernels_meet_at_gemv_rows(m):
    q, scales = int8_weight(48, 200, seed=48)
    x = randn(m, 200, seed=49)
    assert_matches(qm.int8_matmul(x, q, scales), qm.int8_matmul_ref(x, q, scales), torch.float32, f"int8 m={m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_leading_dims_are_kept(dtype):
    x = randn(2, 3, 200, dtype=dtype, seed=7)
    q, scales = int8_weight(48, 200, seed=8)
    got = qm.int8_matmul(x, q, scales)
    assert got.shape == (2, 3, 48)
    assert_matches(got, qm.int8_matmul_ref(x, q, scales), dtype, "int8_matmul [2, 3, K]")
    packed, scales4, mins = int4_weight(48, 200, 64, seed=9)
    got = qm.int4_matmul(x, packed, scales4, mins, 64)
    assert got.shape == (2, 3, 48)
    assert_matches(got, qm.int4_matmul_ref(x, packed, scales4, mins, 64), dtype, "int4_matmul [2, 3, K]")


def test_int4_never_reads_x_past_k():
    # x is a view into wider rows whose columns past K are NaN; the padded weight columns dequantise
    # to each group's min (code 0), not 0, so only the mask keeps the NaNs out of the sums
    packed, scales, mins = int4_weight(64, 200, 128, seed=10)
    assert (mins[:, -1] != 0).all()
    wide = randn(3, 256, seed=11)
    wide[:, 200:] = float("nan")
    x = wide[:, :200]
    got = qm.int4_matmul(x, packed, scales, mins, 128)
    assert not got.isnan().any()
    assert_matches(got, qm.int4_matmul_ref(x.contiguous(), packed, scales, mins, 128), torch.float32, "int4_matmul")


# --- the references against an independent dequantisation ------------------------------------------

def test_int4_reference_matches_codes_computed_by_hand():
    """Random codes, scales and mins, packed by formats.pack_int4; W is rebuilt here from the unpacked
    codes and the format's definition, without formats' unpack or dequantise."""
    n, k, g = 40, 100, 32
    width = formats.padded_in(k, g)
    codes = torch.randint(0, 16, (n, width), generator=gen(12), dtype=torch.uint8)
    scales = torch.rand(n, width // g, generator=gen(13)) * 0.1 + 0.01
    mins = -torch.rand(n, width // g, generator=gen(14))
    packed = formats.pack_int4(codes)
    assert packed.shape == (n, width // 2)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)   # column 0 in the low nibble
    w = torch.empty(n, k, dtype=torch.float64)
    for col in range(k):
        w[:, col] = mins[:, col // g].double() + codes[:, col].double() * scales[:, col // g].double()
    x = torch.randn(5, k, generator=gen(15))
    expected = x.double() @ w.t()
    dev = [t.to(DEV) for t in (x, packed, scales, mins)]
    torch.testing.assert_close(qm.int4_matmul_ref(*dev, g).cpu().double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qm.int4_matmul(*dev, g).cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_int8_reference_matches_codes_computed_by_hand():
    n, k = 40, 100
    q = torch.randint(-127, 128, (n, k), generator=gen(16), dtype=torch.int8)
    scales = torch.rand(n, generator=gen(17)) * 0.01 + 1e-3
    x = torch.randn(5, k, generator=gen(18))
    expected = x.double() @ (q.double() * scales.double()[:, None]).t()
    dev = [t.to(DEV) for t in (x, q, scales)]
    torch.testing.assert_close(qm.int8_matmul_ref(*dev).cpu().double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qm.int8_matmul(*dev).cpu().double(), expected, rtol=1e-5, atol=1e-5)


# --- bad inputs ------------------------------------------------------------------------------------

def _int8_args(**change):
    q, scales = int8_weight(48, 64, seed=19)
    args = dict(x=randn(2, 64, seed=20), qweight=q, scales=scales, bias=None)
    return args | change


def _int4_args(**change):
    packed, scales, mins = int4_weight(48, 100, 64, seed=21)   # packed [48, 64], 2 groups
    args = dict(x=randn(2, 100, seed=22), packed=packed, scales=scales, mins=mins, group_size=64, bias=None)
    return args | change


BAD_INT8 = {
    "x int32": (dict(x=torch.ones(2, 64, dtype=torch.int32, device=DEV)), "x"),
    "K mismatch": (dict(x=randn(2, 65, seed=0)), "qweight"),
    "qweight float": (dict(qweight=randn(48, 64, seed=0)), "qweight"),
    "scales [N, 1]": (dict(scales=torch.ones(48, 1, device=DEV)), "scales"),
    "scales bf16": (dict(scales=torch.ones(48, dtype=torch.bfloat16, device=DEV)), "scales"),
    "bias [N+1]": (dict(bias=torch.zeros(49, device=DEV)), "bias"),
}

BAD_INT4 = {
    "x int64": (dict(x=torch.ones(2, 100, dtype=torch.int64, device=DEV)), "x"),
    "group 48": (dict(group_size=48), "group_size"),
    "packed int8": (dict(packed=torch.zeros(48, 64, dtype=torch.int8, device=DEV)), "packed"),
    "K beyond padding": (dict(x=randn(2, 129, seed=0)), "packed"),
    "K one group short": (dict(x=randn(2, 64, seed=0)), "packed"),
    "scales one group": (dict(scales=torch.ones(48, 1, device=DEV)), "scales"),
    "mins fp16": (dict(mins=torch.zeros(48, 2, dtype=torch.float16, device=DEV)), "mins"),
    "bias bf16": (dict(bias=torch.zeros(48, dtype=torch.bfloat16, device=DEV)), "bias"),
}


@pytest.mark.parametrize("fn", [qm.int8_matmul, qm.int8_matmul_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("case", BAD_INT8)
def test_int8_bad_inputs_name_the_tensor(case, fn):
    change, name = BAD_INT8[case]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        fn(**_int8_args(**change))


@pytest.mark.parametrize("fn", [qm.int4_matmul, qm.int4_matmul_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("case", BAD_INT4)
def test_int4_bad_inputs_name_the_tensor(case, fn):
    change, name = BAD_INT4[case]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        fn(**_int4_args(**change))


def test_strided_weight_is_refused_by_the_kernel():
    q, scales = int8_weight(64, 48, seed=23)
    with pytest.raises(ValueError, match="qweight.*contiguous"):
        qm.int8_matmul(randn(1, 64, seed=24), q.t(), torch.ones(48, device=DEV))


# --- GPU only: compiled kernels at the course model's MLP shapes -----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", [(4864, 896), (896, 4864)], ids=["up", "down"])
def test_gpu_int8_at_model_shapes(n, k, m):
    q, scales = int8_weight(n, k, seed=30)
    x, b = randn(m, k, dtype=torch.bfloat16, seed=31), randn(n, dtype=torch.bfloat16, seed=32)
    for bias in (None, b):
        assert_matches(qm.int8_matmul(x, q, scales, bias), qm.int8_matmul_ref(x, q, scales, bias),
                       torch.bfloat16, f"int8_matmul [{m}, {k}] x [{n}, {k}]^T")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", [(4864, 896), (896, 4864)], ids=["up", "down"])
def test_gpu_int4_at_model_shapes(n, k, m):
    packed, scales, mins = int4_weight(n, k, 128, seed=33)
    x, b = randn(m, k, dtype=torch.bfloat16, seed=34), randn(n, dtype=torch.bfloat16, seed=35)
    for bias in (None, b):
        assert_matches(qm.int4_matmul(x, packed, scales, mins, 128, bias),
                       qm.int4_matmul_ref(x, packed, scales, mins, 128, bias),
                       torch.bfloat16, f"int4_matmul [{m}, {k}] x [{n}, {k}]^T")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_int4_padded_k(m):
    # K = 688 = 5 groups of 128 + 48 columns: the last group is padded to 768
    packed, scales, mins = int4_weight(896, 688, 128, seed=36)
    assert packed.shape == (896, 384)
    x = randn(m, 688, dtype=torch.bfloat16, seed=37)
    assert_matches(qm.int4_matmul(x, packed, scales, mins, 128), qm.int4_matmul_ref(x, packed, scales, mins, 128),
                   torch.bfloat16, f"int4_matmul [{m}, 688] G=128")
