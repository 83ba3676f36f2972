"""Chapter 05: every Triton kernel against its PyTorch reference, and the engine with the kernels forced on.

On a machine without CUDA the kernels run in Triton's interpreter (nanoserve.kernels sets
TRITON_INTERPRET=1 before defining them), so sizes stay small; on a GPU the same tests run compiled,
and the `gpu` tests add realistic sizes.

Tolerances, per dtype, are for |kernel - reference| against a reference computed in fp32 from the
same (already rounded) inputs, unless a test says otherwise:
- fp32: the same arithmetic in another order: a few ulps.
- fp16: one rounding of the output (2^-11 relative) plus fp16 tiles in attention's second matmul.
- bf16: 8 significant bits, one ulp is 2^-8..2^-7 relative. The kernels round where PyTorch rounds
  (up to two roundings in a row, in rms_norm and rotary), but the interpreter rounds fp32 -> bf16
  toward zero where PyTorch and compiled Triton round to nearest: each rounding may land one ulp off,
  so 2^-6 relative (two ulps at worst) plus 2e-2 absolute for results near zero (rotary's differences).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoserve import COURSE_MODEL, kernels
from nanoserve.kernels import activation, cpu_attention, flash_attention, norm, paged_attention, rotary, row_softmax

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) for elementwise kernels, whose one rounding is of the output
ELEMENTWISE_TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (2e-2, 2**-6)}
# absolute tolerance for attention outputs (|out| <= max |v| ~ 3 here)
ATTENTION_ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEV)


def assert_close(got, expected, dtype, what):
    atol, rtol = ELEMENTWISE_TOL[dtype]
    assert got.dtype == dtype and got.shape == expected.shape, f"{what}: {got.dtype} {got.shape} vs {expected.shape}"
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# --- the dispatcher -----------------------------------------------------------------------------

def test_backend_reads_the_environment(monkeypatch):
    auto = "triton" if torch.cuda.is_available() else ("cpu" if cpu_attention.available() else "torch")
    monkeypatch.setenv("NANOSERVE_KERNELS", "torch")
    assert kernels.backend() == "torch" and kernels.select().name == "torch"
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    assert kernels.backend() == "triton" and kernels.select(device=DEV).silu_and_mul is activation.silu_and_mul
    monkeypatch.setenv("NANOSERVE_KERNELS", "auto")
    assert kernels.backend() == auto
    monkeypatch.delenv("NANOSERVE_KERNELS")
    assert kernels.backend() == auto
    assert kernels.backend("torch") == "torch"                 # an argument wins over the environment
    monkeypatch.setenv("NANOSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="NANOSERVE_KERNELS"):
        kernels.backend()
    with pytest.raises(ValueError, match="backend='gpu'"):
        kernels.backend("gpu")


def test_interpreter_is_on_exactly_when_there_is_no_cuda():
    assert kernels.interpreting() == (not torch.cuda.is_available())


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_selected_op_is_the_module_function(name):
    ops = kernels.select(name, DEV)
    gate, up = randn(3, 50, seed=1), randn(3, 50, seed=2)
    expected = (activation.silu_and_mul if name == "triton" else activation.silu_and_mul_ref)(gate, up)
    assert ops.name == name and torch.equal(ops.silu_and_mul(gate, up), expected)


def test_the_backend_is_read_once_not_per_call(monkeypatch):
    ops = kernels.select("torch")
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")     # changing the environment later changes nothing
    assert ops.silu_and_mul is activation.silu_and_mul_ref


WITHOUT_TRITON = """
import os, sys

class NoTriton:  # as on macOS or Windows, where no Triton wheel exists
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(name)

sys.meta_path.insert(0, NoTriton())
import torch
import nanoserve  # the engine imports the kernels package: it must load
from nanoserve import kernels
from nanoserve.kernels import activation
assert not kernels.HAVE_TRITON and kernels.backend() in ("torch", "cpu")
g, u = torch.randn(10), torch.randn(10)
assert torch.equal(kernels.select().silu_and_mul(g, u), torch.nn.functional.silu(g) * u)
try:
    activation.silu_and_mul(g, u)
    raise SystemExit("launching a kernel without Triton did not fail")
except RuntimeError as e:
    assert "Triton is not installed" in str(e), e
os.environ["NANOSERVE_KERNELS"] = "triton"
try:
    kernels.backend()
    raise SystemExit("forcing triton without Triton did not fail")
except RuntimeError as e:
    assert "not installed" in str(e), e
"""


def test_the_references_work_where_triton_is_not_installed():
    env = {k: v for k, v in os.environ.items() if k != "NANOSERVE_KERNELS"}
    run = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]


# --- softmax (the teaching kernel) -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (3, 300)])
def test_softmax(dtype, shape):
    x = randn(*shape, dtype=dtype, seed=sum(shape), scale=4.0)
    assert_close(row_softmax.softmax(x), row_softmax.softmax_ref(x), dtype, "softmax")


def test_softmax_is_safe_with_huge_logits():
    x = torch.tensor([[1000.0, 1001.0, 999.0], [-1e4, 0.0, 88.0]], device=DEV)
    got = row_softmax.softmax(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.softmax(x, -1))
    torch.testing.assert_close(got.sum(-1), torch.ones(2, device=DEV))


# --- RMSNorm, plain and fused with the residual add --------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (2, 5, 37), (9, 100)])
def test_rms_norm(dtype, shape):
    x, w = randn(*shape, dtype=dtype, seed=1), randn(shape[-1], dtype=dtype, seed=2)
    assert_close(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 48), (2, 7, 100)])
def test_fused_add_rms_norm(dtype, shape):
    x, res = randn(*shape, dtype=dtype, seed=3), randn(*shape, dtype=dtype, seed=4, scale=3.0)
    w = randn(shape[-1], dtype=dtype, seed=5)
    normed, new_res = norm.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = norm.fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert_close(new_res, ref_res, dtype, "new residual")
    assert_close(normed, ref_normed, dtype, "normed")


def test_rms_norm_names_the_bad_tensor():
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="x has last dimension 7"):
        norm.rms_norm(torch.ones(2, 7, device=DEV), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.fused_add_rms_norm(torch.ones(2, 8, device=DEV), torch.ones(3, 8, device=DEV), w, 1e-6)


# --- SiLU-and-mul -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 100), (2, 3, 1500)])   # 9000 elements: several programs and a ragged tail
def test_silu_and_mul(dtype, shape):
    gate, up = randn(*shape, dtype=dtype, seed=6, scale=3.0), randn(*shape, dtype=dtype, seed=7)
    assert_close(activation.silu_and_mul(gate, up), activation.silu_and_mul_ref(gate, up), dtype, "silu_and_mul")


# --- rotary embedding ---------------------------------------------------------------------------

def rope_tables(tokens_shape, head_dim, seed):
    """cos/sin [..., head_dim] as layers.RotaryEmbedding makes them: both halves equal, fp32."""
    positions = torch.randint(0, 500, tokens_shape, generator=gen(seed)).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEV), emb.sin().to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [((5,), 4, 4, 16), ((2, 3), 6, 2, 24), ((7,), 3, 1, 80)])
def test_rotary_embedding_in_place(dtype, tokens, heads, kv_heads, head_dim):
    q = randn(*tokens, heads, head_dim, dtype=dtype, seed=8)
    k = randn(*tokens, kv_heads, head_dim, dtype=dtype, seed=9)
    cos, sin = rope_tables(tokens, head_dim, seed=10)
    q_ref, k_ref = rotary.rotary_embedding_ref(q.clone(), k.clone(), cos, sin)
    q_in, k_in = q.clone(), k.clone()
    out_q, out_k = rotary.rotary_embedding(q_in, k_in, cos, sin)
    assert out_q.data_ptr() == q_in.data_ptr() and out_k.data_ptr() == k_in.data_ptr()  # in place
    assert not torch.equal(q_in, q)  # it did rotate
    assert_close(q_in, q_ref, dtype, "rotary q")
    assert_close(k_in, k_ref, dtype, "rotary k")


def test_rotary_reference_matches_the_model_layer():
    from nanoserve.models.layers import apply_rotary
    q, k = randn(2, 3, 4, 16, seed=11), randn(2, 3, 2, 16, seed=12)
    cos, sin = rope_tables((2, 3), 16, seed=13)
    q_ref, k_ref = rotary.rotary_embedding_ref(q.clone(), k.clone(), cos, sin)
    assert torch.equal(q_ref, apply_rotary(q, cos, sin)) and torch.equal(k_ref, apply_rotary(k, cos, sin))


def test_rotary_rejects_a_copy_it_cannot_write_through():
    q = randn(4, 3, 2, 16, seed=14).transpose(0, 1)       # [3, 4, 2, 16] with leading dims not flattenable
    k = randn(3, 4, 2, 16, seed=15)
    cos, sin = rope_tables((3, 4), 16, seed=16)
    with pytest.raises(ValueError, match="q's leading dimensions"):
        rotary.rotary_embedding(q, k, cos, sin)


# --- paged decode attention ---------------------------------------------------------------------

def make_paged(context_lens, num_kv_heads, head_dim, block_size, dtype, seed, poison=False):
    """A one-layer paged cache holding each sequence's keys in shuffled blocks ("holes" between them),
    its block table padded with -1, and the same keys laid out contiguously per sequence for checking.

    With poison=True every cache entry that no sequence owns (free blocks, the tail of each last block)
    is NaN: a kernel that reads one would return NaN.
    """
    g = gen(seed)
    max_blocks = max(math.ceil(n / block_size) for n in context_lens) + 2          # room for -1 padding
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 5          # free blocks too
    fill = float("nan") if poison else 0.0
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill)
    v_cache = torch.full_like(k_cache, fill)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=g).tolist()
    keys, values = [], []
    for b, n in enumerate(context_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        for j in range(math.ceil(n / block_size)):
            blk = free.pop()
            tables[b, j] = blk
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            k_cache[blk, : rows.stop - rows.start] = k[rows].float()
            v_cache[blk, : rows.stop - rows.start] = v[rows].float()
        keys.append(k.float())
        values.append(v.float())
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return (k_cache.to(dtype).to(DEV), v_cache.to(dtype).to(DEV), tables.to(DEV), lens.to(DEV), keys, values)


def decode_attention_by_hand(q, keys, values, scale, window):
    """Per sequence, per head, softmax(q.k) v in fp32 over contiguous keys: independent of any paging."""
    B, H, D = q.shape
    out = torch.zeros(B, H, D)
    for b in range(B):
        k, v = keys[b], values[b]
        if window is not None:
            k, v = k[-window:], v[-window:]
        group = H // k.shape[1]
        for h in range(H):
            s = (k[:, h // group] @ q[b, h].float().cpu()) * scale
            out[b, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


PAGED_CASES = [  # context_lens, heads, kv_heads, head_dim, block_size, window
    ([1, 13, 23], 4, 4, 16, 4, None),       # MHA, a one-token sequence, ragged last blocks
    ([9, 30], 6, 2, 40, 5, None),           # GQA 3:1, head_dim and block_size not powers of two
    ([17, 5, 40], 8, 1, 32, 8, 11),         # MQA 8:1 with a sliding window that skips whole blocks
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_paged_decode_attention(dtype, case):
    lens, H, Hk, D, block_size, window = PAGED_CASES[case]
    k_cache, v_cache, tables, ctx, keys, values = make_paged(lens, Hk, D, block_size, dtype, seed=20 + case)
    q = randn(len(lens), H, D, dtype=dtype, seed=30 + case)
    scale = D ** -0.5
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window)
    ref = paged_attention.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale, window)
    by_hand = decode_attention_by_hand(q, keys, values, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    # the reference (in q's dtype) against fp32 by hand, then the kernel against both
    torch.testing.assert_close(ref.float().cpu(), by_hand, atol=ATTENTION_ATOL[dtype], rtol=0)
    torch.testing.assert_close(got.float().cpu(), by_hand, atol=ATTENTION_ATOL[dtype], rtol=0)
    torch.testing.assert_close(got.float(), ref.float(), atol=ATTENTION_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("splits", [2, 3, 64])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_split_kv_paged_decode_attention(case, splits):
    """Split-KV: each (sequence, kv head) over `splits` programs, partial softmaxes combined. Stretches that hold
    no key (a one-token sequence, a window that skips blocks, more splits than blocks) must weigh nothing."""
    lens, H, Hk, D, block_size, window = PAGED_CASES[case]
    k_cache, v_cache, tables, ctx, keys, values = make_paged(lens, Hk, D, block_size, torch.float32, seed=20 + case)
    q = randn(len(lens), H, D, seed=30 + case)
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, D ** -0.5, window, num_splits=splits)
    one = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, D ** -0.5, window, num_splits=1)
    torch.testing.assert_close(got.cpu(), decode_attention_by_hand(q, keys, values, D ** -0.5, window),
                               atol=ATTENTION_ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(got, one, atol=1e-6, rtol=0)


def test_split_kv_of_an_empty_sequence_is_zeros_and_bad_splits_are_named():
    k_cache, v_cache, tables, ctx, _, _ = make_paged([0, 7], 2, 16, 4, torch.float32, seed=47)
    q = randn(2, 4, 16, seed=48)
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=2)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.isfinite(got).all()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, num_splits=bad)


def test_split_kv_policy_fills_the_gpu_from_the_table_width():
    """Enough splits for PROGRAMS_PER_SM programs per SM, each stretch MIN_BLOCKS_PER_SPLIT blocks at least, at most
    MAX_SPLITS: read from shapes alone (no host sync). On 132 SMs (an H100 or H200):"""
    pa = paged_attention
    wanted = lambda programs: -(-pa.PROGRAMS_PER_SM * 132 // programs)
    assert pa.decode_splits(32, 8, 256, 132) == wanted(256) > 1            # batch 32 at 4k tokens: 256 programs
    assert pa.decode_splits(64, 8, 128, 132) == wanted(512) > 1
    assert pa.decode_splits(512, 8, 256, 132) == 1                          # 4096 programs fill it
    assert pa.decode_splits(1, 8, 4096, 132) == pa.MAX_SPLITS
    assert pa.decode_splits(1, 8, 20, 132) == 20 // pa.MIN_BLOCKS_PER_SPLIT   # short tables: long enough stretches
    assert pa.decode_splits(1, 8, 3, 132) == 1 and pa.decode_splits(0, 8, 64, 132) == 1


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_decode_reads_only_the_sequences_blocks(window, splits):
    # every entry outside a sequence's context is NaN, and the table rows end in -1: one stray read shows
    lens, H, Hk, D, block_size = [3, 21, 10], 6, 3, 24, 4
    k_cache, v_cache, tables, ctx, keys, values = make_paged(lens, Hk, D, block_size, torch.float32, 40, poison=True)
    q = randn(len(lens), H, D, seed=41)
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, D ** -0.5, window,
                                                 num_splits=splits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), decode_attention_by_hand(q, keys, values, D ** -0.5, window),
                               atol=ATTENTION_ATOL[torch.float32], rtol=0)


# --- the C kernel: paged attention on the CPU, in place --------------------------------------------

needs_cc = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler: the C kernel is not built")


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_cpu_paged_attention_decodes(dtype, case):
    lens, H, Hk, D, block_size, window = PAGED_CASES[case]
    k_cache, v_cache, tables, ctx, keys, values = make_paged(lens, Hk, D, block_size, dtype, seed=20 + case)
    q = randn(len(lens), H, D, dtype=torch.float32, seed=30 + case).cpu()
    got = cpu_attention.paged_attention(q, k_cache.cpu(), v_cache.cpu(), tables.cpu(), ctx.int().cpu(), D ** -0.5, window)
    by_hand = decode_attention_by_hand(q, keys, values, D ** -0.5, window)
    torch.testing.assert_close(got, by_hand, atol=1e-5, rtol=0)   # fp32 maths either way (bf16 KV read exactly)


@needs_cc
def test_cpu_paged_attention_reads_only_the_sequences_blocks():
    lens, H, Hk, D, block_size = [3, 21, 10], 6, 3, 24, 4
    k_cache, v_cache, tables, ctx, keys, values = make_paged(lens, Hk, D, block_size, torch.float32, 40, poison=True)
    q = randn(len(lens), H, D, seed=41).cpu()
    got = cpu_attention.paged_attention(q, k_cache.cpu(), v_cache.cpu(), tables.cpu(), ctx.int().cpu(), D ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, decode_attention_by_hand(q, keys, values, D ** -0.5, None), atol=1e-5, rtol=0)


@needs_cc
def test_cpu_paged_attention_queries_at_any_position():
    """Each query token attends up to its own position: the rows of a prefill chunk, causal, in place."""
    lens, H, Hk, D, bs = [40], 4, 2, 16, 8
    k_cache, v_cache, tables, ctx, keys, values = make_paged(lens, Hk, D, bs, torch.float32, seed=45)
    q = randn(40, H, D, seed=46).cpu()
    got = cpu_attention.paged_attention(q, k_cache.cpu(), v_cache.cpu(), tables.cpu(), torch.arange(1, 41, dtype=torch.int32),
                                        D ** -0.5, token_seq=torch.zeros(40, dtype=torch.int32))
    want = prefill_by_hand(q.transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1), 0, D ** -0.5,
                           None).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@needs_cc
def test_cpu_paged_attention_names_the_bad_input():
    k = torch.zeros(4, 4, 2, 16)
    ctx, table = torch.ones(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="block_tables must be int32"):
        cpu_attention.paged_attention(torch.zeros(2, 4, 16), k, k, table.long(), ctx, 1.0)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_attention.paged_attention(torch.zeros(2, 4, 16), k.half(), k.half(), table, ctx, 1.0)
    with pytest.raises(ValueError, match="5 heads over 2 kv heads"):
        cpu_attention.paged_attention(torch.zeros(2, 5, 16), k, k, table, ctx, 1.0)
    with pytest.raises(ValueError, match="a row for every sequence"):
        cpu_attention.paged_attention(torch.zeros(2, 4, 16), k, k, table[:1], ctx, 1.0)


def test_no_compiler_means_the_torch_backend(tmp_path):
    """Without a C compiler, auto falls back to the references and says why "cpu" cannot be had."""
    code = ("import os; os.environ['PATH'] = ''; os.environ['CC'] = '/nonexistent/cc'\n"
            "from nanoserve import kernels\n"
            "assert kernels.backend() in ('torch', 'triton'), kernels.backend()\n"
            "try:\n    kernels.backend('cpu')\nexcept RuntimeError as e:\n    print(e)\n")
    env = dict(os.environ, NANOSERVE_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cannot be built" in run.stdout


def test_paged_decode_names_the_bad_tensor():
    k_cache = torch.zeros(4, 4, 2, 16, device=DEV)
    q = torch.zeros(2, 6, 16, device=DEV)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention.paged_decode_attention(q, k_cache, k_cache, tables.long(), tables[:, 0], 1.0)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        paged_attention.paged_decode_attention(torch.zeros(2, 5, 16, device=DEV), k_cache, k_cache, tables,
                                               tables[:, 0], 1.0)


# --- flash prefill --------------------------------------------------------------------------------

FLASH_CASES = [  # heads, kv_heads, head_dim, q_offset, Tq, window
    (2, 2, 16, 0, 21, None),        # a whole prompt, MHA, Tq not a multiple of the tile
    (6, 2, 24, 13, 19, None),       # a later chunk (chunked prefill), GQA 3:1, head_dim 24
    (4, 1, 40, 5, 37, 9),           # MQA with a sliding window narrower than a tile
]


def prefill_by_hand(q, k, v, q_offset, scale, window):
    H, Tq, _ = q.shape
    group = H // k.shape[0]
    q, k, v = q.float().cpu(), k.float().cpu(), v.float().cpu()
    out = torch.zeros_like(q)
    for h in range(H):
        for i in range(Tq):
            p = q_offset + i
            lo = 0 if window is None else max(0, p - window + 1)
            s = (k[h // group, lo:p + 1] @ q[h, i]) * scale
            out[h, i] = torch.softmax(s, 0) @ v[h // group, lo:p + 1]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(FLASH_CASES)))
def test_flash_prefill(dtype, case):
    H, Hk, D, q_offset, Tq, window = FLASH_CASES[case]
    q = randn(H, Tq, D, dtype=dtype, seed=50 + case)
    k = randn(Hk, q_offset + Tq, D, dtype=dtype, seed=60 + case)
    v = randn(Hk, q_offset + Tq, D, dtype=dtype, seed=70 + case)
    scale = D ** -0.5
    got = flash_attention.flash_prefill(q, k, v, q_offset, scale, window, block_m=16, block_n=16)
    ref = flash_attention.flash_prefill_ref(q, k, v, q_offset, scale, window)
    by_hand = prefill_by_hand(q, k, v, q_offset, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(ref.float().cpu(), by_hand, atol=ATTENTION_ATOL[dtype], rtol=0)
    torch.testing.assert_close(got.float().cpu(), by_hand, atol=ATTENTION_ATOL[dtype], rtol=0)


def test_flash_prefill_checks_the_positions():
    q, k = torch.zeros(2, 5, 16, device=DEV), torch.zeros(2, 7, 16, device=DEV)
    with pytest.raises(ValueError, match="q_offset"):
        flash_attention.flash_prefill(q, k, k, 0, 1.0)


# --- the engine with the kernels forced on ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=150, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    shutil.copy(Path(COURSE_MODEL) / "tokenizer.json", path)   # LLM wants one; the prompts are token ids
    return path


def test_model_logits_with_triton_kernels_match_torch(tiny_qwen3, monkeypatch):
    from nanoserve import models
    model = models.load(tiny_qwen3, device=DEV, dtype=torch.float32)
    ids = torch.randint(0, 150, (2, 11), generator=gen(80)).to(DEV)
    calls = {}

    def counted(module, name):
        fn = getattr(module, name)

        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)
        monkeypatch.setattr(module, name, wrapper)

    for module, name in [(norm, "rms_norm"), (norm, "fused_add_rms_norm"), (activation, "silu_and_mul"),
                         (rotary, "rotary_embedding")]:
        counted(module, name)
    with torch.inference_mode():
        expected = model(ids)                   # a loaded model runs the references until told otherwise
        assert calls == {}
        got = model.use_kernels(kernels.select("triton", DEV))(ids)
    # per layer: input, q and k norms; the post-attention norm fused with its residual add; one rotary;
    # one MLP gate. Plus the final norm.
    assert calls == {"rms_norm": 2 * 3 + 1, "fused_add_rms_norm": 2, "rotary_embedding": 2, "silu_and_mul": 2}
    assert expected.std() > 0.05
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_engine_greedy_output_with_triton_kernels_equals_torch(tiny_qwen3, monkeypatch):
    from nanoserve import LLM, SamplingParams
    prompts = [[5, 17, 99, 3, 42, 7, 8], [120, 4, 66]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("NANOSERVE_KERNELS", name)
        llm = LLM(model=str(tiny_qwen3), device=DEV.type, dtype="float32", max_num_seqs=2)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 8 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]


# --- GPU only: compiled kernels at realistic sizes ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_elementwise_at_model_sizes(dtype):
    x, res, w = randn(256, 4096, dtype=dtype, seed=90), randn(256, 4096, dtype=dtype, seed=91), randn(4096, dtype=dtype, seed=92)
    for got, ref in zip(norm.fused_add_rms_norm(x, res, w, 1e-6), norm.fused_add_rms_norm_ref(x, res, w, 1e-6)):
        assert_close(got, ref, dtype, "fused_add_rms_norm")
    gate, up = randn(256, 11008, dtype=dtype, seed=93), randn(256, 11008, dtype=dtype, seed=94)
    assert_close(activation.silu_and_mul(gate, up), activation.silu_and_mul_ref(gate, up), dtype, "silu_and_mul")
    q, k = randn(256, 32, 128, dtype=dtype, seed=95), randn(256, 8, 128, dtype=dtype, seed=96)
    cos, sin = rope_tables((256,), 128, seed=97)
    q_ref, k_ref = rotary.rotary_embedding_ref(q.clone(), k.clone(), cos, sin)
    rotary.rotary_embedding(q, k, cos, sin)
    assert_close(q, q_ref, dtype, "rotary q")
    assert_close(k, k_ref, dtype, "rotary k")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_paged_decode_long_context(dtype):
    lens = [1, 100, 1000, 4097]
    k_cache, v_cache, tables, ctx, _, _ = make_paged(lens, 8, 128, 16, dtype, seed=98)
    q = randn(len(lens), 32, 128, dtype=dtype, seed=99)
    for window, splits in ((None, None), (512, None), (None, 1), (None, 7)):   # None: the device's policy
        got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 128 ** -0.5, window,
                                                     num_splits=splits)
        ref = paged_attention.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, ctx,
                                                         128 ** -0.5, window)
        torch.testing.assert_close(got.float(), ref, atol=ATTENTION_ATOL[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_flash_prefill_long_prompt(dtype):
    q, k, v = randn(32, 1000, 128, dtype=dtype, seed=100), randn(8, 1500, 128, dtype=dtype, seed=101), \
        randn(8, 1500, 128, dtype=dtype, seed=102)
    for window in (None, 256):
        got = flash_attention.flash_prefill(q, k, v, 500, 128 ** -0.5, window, block_m=64, block_n=64)
        ref = flash_attention.flash_prefill_ref(q.float(), k.float(), v.float(), 500, 128 ** -0.5, window)
        torch.testing.assert_close(got.float(), ref, atol=ATTENTION_ATOL[dtype], rtol=0)
