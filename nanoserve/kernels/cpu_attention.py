"""Paged attention on the CPU that reads the KV blocks in place: a small C kernel (`csrc/paged_attention.c`).

PyTorch has no op that attends through a block table on the CPU, so the torch path gathers each
sequence's blocks into a contiguous copy before `scaled_dot_product_attention`: every layer, every
step, the whole context is copied and then read again. vLLM's CPU backend has C++ kernels for this;
ours is one C function of about 60 lines. It is compiled with the machine's C compiler the first
time it is needed (about a second) and cached per user; where there is no compiler, `available()`
says why and the engine keeps the PyTorch path.

    out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, token_seq=None)

q [N, heads, d] float32; k_cache/v_cache [blocks, block_size, kv_heads, d] float32 or bfloat16 (one
layer); block_tables [B, W] int32; context_lens [N] int32: query t attends keys 0 .. context_lens[t] - 1
(its own position is the last) of sequence token_seq[t], or of sequence t when token_seq is None (decodes).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]

_lib = None
_error: str | None = None


def _cache_dir() -> Path:
    """Per user: $NANOSERVE_CACHE_DIR, else $XDG_CACHE_HOME/nanoserve or ~/.cache/nanoserve, else the temp dir."""
    if os.environ.get("NANOSERVE_CACHE_DIR"):
        return Path(os.environ["NANOSERVE_CACHE_DIR"])
    d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanoserve"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"nanoserve-{getattr(os, 'getuid', lambda: 'user')()}"


def _cpu_id() -> str:
    """-march=native code runs on this CPU model only: the build is keyed by it."""
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc] + FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:   # a compiler without OpenMP (Apple clang): the same kernel on one thread
            flags = [f for f in FLAGS if f != "-fopenmp"]
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)   # atomic: concurrent builds (parallel tests) never load half a file
    return target


def _load():
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    if platform.system() == "Windows":
        _error = "the C kernel is built for Linux and macOS only"
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (RuntimeError, OSError) as e:
        _error = str(e)
        return None
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    for fn in (lib.paged_attention_f32, lib.paged_attention_bf16):
        fn.argtypes = [ptr] * 7 + [i64] * 5 + [i64, f32, i64, i64]
        fn.restype = None
    lib.max_group.restype = lib.max_head_dim.restype = i64
    _lib = lib
    return lib


def available() -> bool:
    """True when the kernel is compiled (or could be now) on this machine."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                    sliding_window: int | None = None, token_seq: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query token over its own sequence's keys, read in place from the blocks."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {_error}")
    N, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"KV cache dtype {k_cache.dtype}: the CPU kernel reads float32 or bfloat16")
    if heads % kv_heads or heads // kv_heads > lib.max_group() or d > lib.max_head_dim():
        raise ValueError(f"{heads} heads over {kv_heads} kv heads of {d}: the CPU kernel takes at most "
                         f"{lib.max_group()} query heads per kv head and head_dim {lib.max_head_dim()}")
    ints = dict(block_tables=block_tables, context_lens=context_lens) | ({} if token_seq is None else
                                                                          dict(token_seq=token_seq))
    for name, t in ints.items():
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    for name, t in dict(k_cache=k_cache, v_cache=v_cache, **ints).items():
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    rows = N if token_seq is None else int(token_seq.max()) + 1 if N else 0
    if context_lens.shape != (N,) or block_tables.shape[0] < rows:
        raise ValueError(f"context_lens {list(context_lens.shape)} must be [{N}] and block_tables "
                         f"{list(block_tables.shape)} must have a row for every sequence")
    qf = q.float().contiguous()
    out = torch.empty(N, heads, d, dtype=torch.float32)
    fn = lib.paged_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_attention_f32
    args = [qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            None if token_seq is None else token_seq.data_ptr(), context_lens.data_ptr(), out.data_ptr()]
    args += [heads, kv_heads, d, block_size, block_tables.shape[1], sliding_window or 0, scale]
    with torch.profiler.record_function("nanoserve::cpu_paged_attention"):   # so traces show where the time went
        fn(*args, 0, N * kv_heads)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
