"""Weight-only quantization at decode: tokens/s and memory-bandwidth use per weight format, against gpt-fast's int8.

A batch-1 decode step reads every weight once for ~2 FLOPs each: memory-bound, so fewer bytes per weight
should mean proportionally more tokens/s, as far as the kernel that reads them keeps up. This benchmark
decodes a real-shape model (a shipped public config, seeded random weights, nothing downloaded) with its
weights stored as fp32, bf16, int8 (per channel), int4 (groups of 128) and int4-g32, through the engine,
and reports per variant: the bytes one step reads (linear weights + the KV cache read + one embedding row
per sequence), the median step, tokens/s, the GB/s that makes, its share of this machine's measured read
bandwidth, and speed-ups against fp32 and against the peer.

The named peer is gpt-fast's int8 weight-only path (pytorch-labs/gpt-fast, quantize.py), written here from
its description: int8 codes with one scale per output channel, kept in the activations' dtype, and
`F.linear(x, weight.to(x.dtype)) * scales`, left to torch.compile to fuse the dequantisation into the
matmul (gpt-fast compiles its decode step). Every nn.Linear of a bf16 copy of the model (gpt-fast's
precision) becomes one, holding the same codes and scales as our int8 (`quant.quantize_int8`), and it runs
through our engine's compiled decode (compilation="compile"): only the linear recipe differs. Rows:

    fp32, bf16             the model unquantized, eager
    int8, int4, int4-g32   ours (`quant.quantize_model`), eager: the CPU's aten kernels, Triton on CUDA
    int8+compile           ours under compilation="compile" (a failure is recorded, with its error)
    gpt-fast-int8          the peer, compilation="compile"
    gpt-fast-int8-eager    the peer without compiling: what the recipe costs when nothing fuses it
    torchao-int8, -int4    torchao's Int8WeightOnlyConfig / Int4WeightOnlyConfig (`quantize_`) on a bf16
                           copy, compilation="compile"; only where torchao imports (skipped, with the
                           reason, otherwise; torchao is not a requirement of this repository)

All variants of a batch size are timed interleaved, round robin (`perf.interleaved_decode`), so a noisy
neighbour slows them alike: the ratios hold better than the absolute numbers. The first decode step of
each variant is untimed and, for a compiled row, compiles its graph: its seconds are reported apart, as
a cost (for qwen2.5-0.5b on 2 cores, 60-90 s per compiled row with cold inductor caches, 5-10 s warm;
--cold-compile turns the caches off). The targets (int8 >= 2x fp32 tokens/s at batch 1; int4 above int8) are
checked as measured and printed as PASS / FAIL, never asserted.

    python benchmarks/quantization.py                          # qwen2.5-0.5b, batch 1, CPU (see below)
    python benchmarks/quantization.py --batch 1 8              # and batch 8 (weights read once per step)
    python benchmarks/quantization.py --model smollm2-135m     # or a config.json path / model directory
    python benchmarks/quantization.py --variants fp32 int8 int4 gpt-fast-int8
    python benchmarks/quantization.py --quick                  # smollm2-135m, fewer steps (compiling still
                                                               # dominates a first run: ~80 s a compiled row)
    python benchmarks/quantization.py --device cuda

On 2 CPU cores the default run takes ~1 min once inductor's caches are warm, and ~4-5 min the first
time (two graphs to compile cold, six models to build); torchao's row, where torchao is installed, adds
a third compile (~1.5 min cold).
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

# Run as a script, this folder comes first on sys.path, and benchmarks/kernels.py would shadow the
# `kernels` package that transformers looks for: imports resolve from the repository, not from here.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from nanoserve import models, perf, quant  # noqa: E402
from nanoserve.course.bench import fill_defaults, machine_info, save_record  # noqa: E402
from nanoserve.engine.compiled_decode import width_bucket  # noqa: E402
from nanoserve.models.loader import resolve_dtype  # noqa: E402
from nanoserve.models.random_weights import config_file  # noqa: E402
from nanoserve.quant.linear import QuantLinear  # noqa: E402

PEER = "gpt-fast-int8"


class Variant(NamedTuple):
    name: str          # the row's name, in the table and the record
    model: str         # the model it runs (rows that differ only in compilation share one)
    compilation: str   # the engine's mode
    what: str          # one line for the record


VARIANTS = [
    Variant("fp32", "fp32", "eager", "unquantized float32"),
    Variant("bf16", "bf16", "eager", "unquantized bfloat16"),
    Variant("int8", "int8", "eager", "ours: per-channel int8, quant.quantize_model"),
    Variant("int4", "int4", "eager", "ours: int4, groups of 128 with a min"),
    Variant("int4-g32", "int4-g32", "eager", "ours: int4, groups of 32 with a min"),
    Variant("int8+compile", "int8", "compile", "ours: int8 under the engine's compiled decode"),
    Variant(PEER, "peer", "compile", "gpt-fast's int8 recipe (bf16), under the engine's compiled decode"),
    Variant(PEER + "-eager", "peer", "eager", "gpt-fast's int8 recipe (bf16), eager: nothing fuses it"),
    Variant("torchao-int8", "torchao-int8", "compile", "torchao Int8WeightOnlyConfig (bf16), compiled decode"),
    Variant("torchao-int4", "torchao-int4", "compile", "torchao Int4WeightOnlyConfig g128 (bf16), compiled decode"),
]
NAMES = [v.name for v in VARIANTS]
# many short rounds: a burst of noise lands on a few steps of every variant, not on all of one variant's.
# Prompt 32 + up to 30 steps keeps every step's context at 3 or 4 blocks of 16: one graph per compiled row.
DEFAULTS = dict(model="qwen2.5-0.5b", prompt=32, rounds=8, steps=3)
QUICK = dict(model="smollm2-135m", prompt=32, rounds=4, steps=2)


class GptFastInt8Linear(nn.Module):
    """gpt-fast's int8 weight-only linear, from its description: int8 codes [out, in], one scale per output
    channel stored in the activations' dtype, y = F.linear(x, weight.to(x.dtype)) * scales (+ bias, which
    Qwen's q/k/v have and gpt-fast's Llama does not).

    Eager, every call writes a full-precision copy of the weight and reads it back. Compiled, inductor
    recognises this very pattern (bf16 activations and scales, int8 weight) and calls PyTorch's fused
    weight-only int8 matmul instead: the fusion gpt-fast counts on. Its patterns expect the activations of
    gpt-fast's model, [batch, seq, features]; our compiled decode gives the output head [batch, features],
    which no pattern matches (the head then dequantises in full), so a 2-D input gets gpt-fast's shape.
    The scales are stored in the activations' dtype, as gpt-fast stores them: cast in the forward
    (`scales.to(x.dtype)`), they make inductor's lowering of the pattern fail (torch 2.13: "InductorError:
    AssertionError: <class 'torch._inductor.ir.Pointwise'>").
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        q, scales = quant.quantize_int8(linear.weight.detach())   # the codes and scales of our int8
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.forward(x[None])[0]
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.no_grad()
def gpt_fast_int8(model: nn.Module) -> nn.Module:
    """Every nn.Linear of `model` replaced by a GptFastInt8Linear in the model's dtype, in place."""
    dtype = next(model.parameters()).dtype
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, GptFastInt8Linear(m, dtype))
    return model


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes a tensor holds; for a tensor subclass (torchao's), those of the tensors inside it."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n, None)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every linear layer's weight, codes, scales and bias: `quant.linear_weight_bytes`, extended
    to the peer's layers and to torchao's quantized weights (for our rows the two agree)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, QuantLinear, GptFastInt8Linear)):
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if id(t) not in seen:
                    seen.add(id(t))
                    total += tensor_bytes(t)
    return total


def sibling(name: str):
    """A benchmark script beside this one, as a module (for `read_bandwidth`, `last_level_cache_bytes`)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_torchao():
    """(torchao, None) or (None, why it does not import)."""
    try:
        import torchao
        from torchao.quantization import quantize_  # noqa: F401
        return torchao, None
    except Exception as e:  # ImportError, or a torchao built for another torch failing as it loads
        return None, f"torchao does not import: {type(e).__name__}: {first_line(e)}"


def model_label(model: str) -> str:
    """How the record names the model: a shipped config's name, else the model directory's name (never a
    path of the machine that ran it)."""
    if model in models.real_shape_configs():
        return model
    path = Path(model)
    return (path.parent if path.is_file() else path).resolve().name


def first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


def inductor_counter(name: str) -> int:
    from torch._dynamo.utils import counters
    return counters["inductor"][name]


class Skip(Exception):
    """A variant that cannot run here, for a reason that is the whole message."""


class ModelBank:
    """The models the variants run, each built on first use and shared by the rows that run it."""

    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        self.quant_dtype = resolve_dtype(args.dtype, self.device)   # the base of our quantized rows
        self.models: dict[str, nn.Module] = {}
        self.build_s: dict[str, float] = {}
        self.skipped: dict[str, str] = {}   # model key -> why it could not be built

    def base(self, dtype: torch.dtype) -> nn.Module:
        """The unquantized model in `dtype`: drawn once in float32 (as random_model draws), then cast."""
        key = f"base-{dtype}"
        if key not in self.models:
            self.models[key] = (models.random_model(self.args.model, dtype=dtype, device=self.device,
                                                    seed=self.args.seed) if dtype == torch.float32
                                else copy.deepcopy(self.base(torch.float32)).to(dtype))
        return self.models[key]

    def get(self, key: str) -> nn.Module | None:
        if key in self.models:
            return self.models[key]
        if key in self.skipped:
            return None
        t0 = time.perf_counter()
        try:
            model = self._build(key)
        except Skip as e:
            self.skipped[key] = str(e)
            return None
        except Exception as e:
            self.skipped[key] = f"{type(e).__name__}: {first_line(e)}"
            return None
        self.models[key] = model
        self.build_s[key] = time.perf_counter() - t0
        return model

    @torch.no_grad()
    def _build(self, key: str) -> nn.Module:
        if key == "fp32":
            return self.base(torch.float32)
        if key == "bf16":
            return self.base(torch.bfloat16)
        if key in ("int8", "int4", "int4-g32"):
            return quant.quantize_model(copy.deepcopy(self.base(self.quant_dtype)), key)
        if key == "peer":
            return gpt_fast_int8(copy.deepcopy(self.base(torch.bfloat16)))
        if key.startswith("torchao-"):
            torchao, why = import_torchao()
            if torchao is None:
                raise Skip(why)
            from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
            # set_inductor_config=False: torchao would otherwise change inductor's global settings, and
            # with them how every other compiled row here compiles
            config = (Int8WeightOnlyConfig(set_inductor_config=False) if key == "torchao-int8"
                      else Int4WeightOnlyConfig(group_size=128, set_inductor_config=False))
            model = copy.deepcopy(self.base(torch.bfloat16))
            quantize_(model, config)
            return model
        raise KeyError(key)


def measure_batch(batch: int, variants: list[Variant], bank: ModelBank, args) -> tuple[list, list]:
    """Every variant at one batch size, timed interleaved: (rows, failures). Utilisation is filled in later."""
    max_steps = 2 + args.rounds * args.steps   # our untimed first step, interleaved_decode's, then the timed ones
    timers, setup, failed = {}, {}, []
    for v in variants:
        model = bank.get(v.model)
        if model is None:
            continue
        woq0, hits0, misses0 = (inductor_counter(n) for n in ("woq_matcher_count", "fxgraph_cache_hit",
                                                               "fxgraph_cache_miss"))
        # on a GPU an eager decode step is launch-bound (chapter 06), which would hide every byte saved:
        # the "eager" rows run as the engine does there by default, one CUDA graph per step
        mode = "cudagraph" if args.device == "cuda" and v.compilation == "eager" else v.compilation
        t0 = time.perf_counter()
        try:
            timer = perf.DecodeTimer(model, batch_size=batch, prompt_len=args.prompt, max_steps=max_steps,
                                     compilation=mode)
            timer.step_seconds(1)   # the first decode step: a compiled row compiles its graph here
        except Exception as e:
            failed.append(dict(variant=v.name, batch=batch, error=f"{type(e).__name__}: {str(e).strip()[:2000]}"))
            print(f"  batch {batch}: {v.name} FAILED: {type(e).__name__}: {first_line(e)}")
            gc.collect()
            continue
        first = time.perf_counter() - t0
        m = timer.engine.compile_metrics()
        setup[v.name] = dict(first_step_s=first, compile_s=m["compile_seconds"], num_compiles=m["num_compiles"],
                             woq_fusions=inductor_counter("woq_matcher_count") - woq0,
                             fxgraph_cache_hits=inductor_counter("fxgraph_cache_hit") - hits0,
                             fxgraph_cache_misses=inductor_counter("fxgraph_cache_miss") - misses0)
        timers[v.name] = timer
        note = f" (compiling: {m['compile_seconds']:.1f} s)" if mode == "compile" else ""
        print(f"  batch {batch}: {v.name} ready, first step {first:.1f} s{note}", flush=True)
    if not timers:
        return [], failed
    medians = perf.interleaved_decode(timers, rounds=args.rounds, steps=args.steps)

    cfg = next(iter(timers.values())).engine.model.config
    mean_context = args.prompt + (max_steps + 3) / 2   # timed steps 3..max_steps read prompt + step tokens
    rows = []
    for v in variants:
        if v.name not in timers:
            continue
        timer, step = timers[v.name], medians[v.name]
        model = timer.engine.model
        kv_elem = timer.engine.kv_cache.k.element_size()
        kv = int(mean_context * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem)
        emb = model.model.embed_tokens.weight
        emb_row = emb.shape[1] * emb.element_size()
        weights = weight_bytes(model)
        per_step = weights + batch * (kv + emb_row)
        m = timer.engine.compile_metrics()
        rows.append(dict(batch=batch, variant=v.name, model_key=v.model, compilation=timer.engine.config.compilation,
                         what=v.what,
                         dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                         weight_bytes=weights, kv_read_bytes_per_seq=kv, embedding_row_bytes=emb_row,
                         bytes_per_step=per_step, median_step_s=step, tokens_per_s=batch / step,
                         achieved_bytes_per_s=per_step / step, utilisation=None,
                         steps=args.rounds * args.steps,
                         graphs_compiled_while_timing=m["num_compiles"] - setup[v.name]["num_compiles"],
                         **setup[v.name]))
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        for ref, key in (("fp32", "speedup_vs_fp32"), (PEER, "speedup_vs_peer")):
            r[key] = by_name[ref]["median_step_s"] / r["median_step_s"] if ref in by_name else None
    del timers
    gc.collect()
    return rows, failed


def print_table(rows: list[dict], read_bw: float) -> None:
    def ratio(x):
        return f"{x:.2f}x" if x is not None else "-"
    batch = rows[0]["batch"]
    print(f"\nbatch {batch}: bytes read per step = linear weights + {batch} x (KV read + one embedding row); "
          f"utilisation of the measured read bandwidth, {read_bw / 1e9:.1f} GB/s")
    print(f"{'variant':<22} {'MB/step':>9} {'step ms':>9} {'tokens/s':>9} {'GB/s':>7} {'util':>6} "
          f"{'vs fp32':>8} {'vs peer':>8}")
    for r in rows:
        print(f"{r['variant']:<22} {r['bytes_per_step'] / 1e6:>9.1f} {r['median_step_s'] * 1e3:>9.2f} "
              f"{r['tokens_per_s']:>9.2f} {r['achieved_bytes_per_s'] / 1e9:>7.2f} {r['utilisation']:>6.0%} "
              f"{ratio(r['speedup_vs_fp32']):>8} {ratio(r['speedup_vs_peer']):>8}")


def targets(rows: list[dict]) -> list[dict]:
    """The chapter's targets at batch 1, as measured: never asserted, only reported."""
    at1 = {r["variant"]: r for r in rows if r["batch"] == 1}
    out = []

    def check(name, a, b, factor):
        if a not in at1 or b not in at1:
            out.append(dict(target=name, result="n/a", detail=f"needs the {a} and {b} rows at batch 1"))
            return
        ta, tb = at1[a]["tokens_per_s"], at1[b]["tokens_per_s"]
        ok = ta >= factor * tb if factor != 1 else ta > tb
        out.append(dict(target=name, result="PASS" if ok else "FAIL", ratio=ta / tb,
                        detail=f"{a} {ta:.2f} tokens/s, {b} {tb:.2f} tokens/s: {ta / tb:.2f}x"))

    check("int8 >= 2x fp32 tokens/s at batch 1", "int8", "fp32", 2)
    check("int4 above int8 (tokens/s, batch 1)", "int4", "int8", 1)
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"a shipped config ({', '.join(models.real_shape_configs())}), random weights; "
                                    f"or a config.json path / model directory (default: {DEFAULTS['model']})")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the model our int8/int4 rows quantize (auto: float32 on a CPU, bfloat16 on CUDA); "
                         "the peer and torchao rows are bfloat16, their recipes' precision")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (default: 1)")
    ap.add_argument("--variants", nargs="+", choices=NAMES, metavar="VARIANT",
                    help=f"rows to run, of: {', '.join(NAMES)} (default: all)")
    ap.add_argument("--prompt", type=int, help=f"prompt tokens (default: {DEFAULTS['prompt']})")
    ap.add_argument("--rounds", type=int, help=f"interleaved rounds (default: {DEFAULTS['rounds']})")
    ap.add_argument("--steps", type=int,
                    help=f"decode steps timed per variant per round (default: {DEFAULTS['steps']})")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ap.add_argument("--threads", type=int, default=cores,
                    help="torch threads (default: every core this process may use)")
    ap.add_argument("--seed", type=int, default=0, help="random weights")
    ap.add_argument("--cold-compile", action="store_true",
                    help="turn inductor's on-disk caches off, so compile seconds are a first launch's")
    ap.add_argument("--quick", action="store_true", help=f"a short run: {QUICK} unless given")
    ap.add_argument("--save", type=lambda s: Path(s) if s else None, default=Path("benchmarks/results"),
                    help="directory for the JSON record ('' saves none)")
    args = ap.parse_args(argv)
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    for key in ("batch", "prompt", "rounds", "steps", "threads"):
        values = getattr(args, key)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            ap.error(f"--{key} must be at least 1, got {values}")
    try:
        args.config = models.ModelConfig.from_path(config_file(args.model))
    except (ValueError, OSError) as e:
        ap.error(f"--model {args.model!r}: {e}")
    args.batch = sorted(set(args.batch))
    args.variants = [n for n in NAMES if n in (args.variants or NAMES)]   # table order, once each
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cold_compile:
        from torch._inductor import config as inductor_config
        inductor_config.force_disable_caches = True
    started = time.perf_counter()
    device = torch.device(args.device)
    variants = [v for v in VARIANTS if v.name in args.variants]
    cfg = args.config
    print(f"weight-only quantization at decode: {model_label(args.model)} (random weights, "
          f"{cfg.num_parameters / 1e6:.0f}M parameters) on {args.device}, {args.threads} threads; "
          f"batch {args.batch}, prompt {args.prompt}, "
          f"{args.rounds} rounds x {args.steps} steps; peer: {PEER}")
    total = 2 + args.rounds * args.steps
    widths = {width_bucket(-(-c // 16)) for c in range(args.prompt + 1, args.prompt + total + 1)}
    if len(widths) > 1 and any(v.compilation != "eager" for v in variants):
        print(f"note: the decoded contexts span block-table widths {sorted(widths)}: a compiled row compiles a "
              f"graph per width, some while timing (choose --prompt so that they do not)")

    read_bandwidth = sibling("decode_bandwidth").read_bandwidth
    read_before = read_bandwidth(device)
    llc = sibling("decode_latency").last_level_cache_bytes(device)
    copy_bw = perf.measure_ceilings(device=device).mem_bw
    print(f"measured memory bandwidth: read {read_before / 1e9:.1f} GB/s (summing a 1 GiB buffer; again after "
          f"timing, the better one counts), "
          f"copy {copy_bw / 1e9:.1f} GB/s (measure_ceilings, measured in this run)")

    torchao, torchao_why = (None, None)
    if any(v.model.startswith("torchao-") for v in variants):
        torchao, torchao_why = import_torchao()
        if torchao is None:
            print(f"skipping torchao-int8, torchao-int4: {torchao_why}")

    bank = ModelBank(args)
    rows, failed = [], []
    for batch in args.batch:
        print(f"\nbatch {batch}: building and warming up {len(variants)} variants")
        batch_rows, batch_failed = measure_batch(batch, variants, bank, args)
        rows += batch_rows
        failed += batch_failed
    # a ceiling is what the machine reaches, and a neighbour's load only lowers a measurement: the better of two
    read_after = read_bandwidth(device)
    read_bw = max(read_before, read_after)
    for r in rows:
        r["utilisation"] = r["achieved_bytes_per_s"] / read_bw
    print(f"\nread bandwidth after timing: {read_after / 1e9:.1f} GB/s (before: {read_before / 1e9:.1f} GB/s)")
    skipped = [dict(variant=v.name, reason=bank.skipped[v.model]) for v in variants if v.model in bank.skipped]
    wall = time.perf_counter() - started

    for batch in args.batch:
        batch_rows = [r for r in rows if r["batch"] == batch]
        if batch_rows:
            print_table(batch_rows, read_bw)
    smallest = min((r["weight_bytes"] for r in rows), default=None)
    if llc and smallest is not None and smallest <= llc:
        print(f"note: {smallest / 1e6:.1f} MB of weights fit in this machine's last-level cache ({llc / 1e6:.0f} MB): "
              f"GB/s and utilisation are not memory bandwidth there")
    for s in skipped:
        print(f"skipped {s['variant']}: {s['reason']}")
    for f in failed:
        print(f"FAILED {f['variant']} (batch {f['batch']}): {first_line(Exception(f['error']), 500)}")

    compiled = [r for r in rows if r["compilation"] == "compile"]
    if compiled:
        cache = "off (--cold-compile)" if args.cold_compile else "on"
        print(f"\ncompile seconds (the first decode step of each compiled row, untimed above; inductor caches "
              f"{cache}: a first launch of qwen2.5-0.5b pays 60-90 s per row on 2 cores, a warm cache 5-10 s):")
        for r in compiled:
            state = ("cold (caches off)" if args.cold_compile else "warm (cache hit)" if r["fxgraph_cache_hits"]
                     else "cold (cache miss)")
            print(f"  {r['variant']:<22} batch {r['batch']}: {r['compile_s']:6.1f} s, {state}; "
                  f"inductor int8 weight-only fusions: {r['woq_fusions']}; "
                  f"graphs compiled while timing: {r['graphs_compiled_while_timing']}")
    print(f"\nbuilding the models (copy + quantize): " + ", ".join(f"{k} {s:.1f} s" for k, s in bank.build_s.items()))
    checks = targets(rows)
    print("targets (as measured, batch 1):")
    for c in checks:
        print(f"  {c['target']}: {c['result']} ({c['detail']})")
    print(f"wall {wall:.0f} s")

    record = dict(benchmark="quantization", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), versions=dict(torch=torch.__version__,
                                                        torchao=getattr(torchao, "__version__", None)),
                  device=args.device, threads=args.threads,
                  model=dict(name=model_label(args.model), weights="random", parameters=cfg.num_parameters,
                             layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                             tied_head=cfg.tie_word_embeddings),
                  quant_base_dtype=str(bank.quant_dtype).removeprefix("torch."),
                  args=dict(batch=args.batch, variants=args.variants, prompt=args.prompt, rounds=args.rounds,
                            steps=args.steps, seed=args.seed, dtype=args.dtype, cold_compile=args.cold_compile,
                            quick=args.quick),
                  read_bytes_per_s=read_bw, read_bytes_per_s_before_after=[read_before, read_after],
                  copy_bytes_per_s=copy_bw, last_level_cache_bytes=llc,
                  peer=dict(name=PEER, what="gpt-fast's int8 weight-only linear (pytorch-labs/gpt-fast, quantize.py), "
                                            "written from its description: int8 codes, per-channel scales in bf16, "
                                            "F.linear(x, weight.to(x.dtype)) * scales, compiled; our int8's codes "
                                            "and scales; run by our engine with compilation='compile'"),
                  torchao=dict(available=torchao is not None, version=getattr(torchao, "__version__", None),
                               reason=torchao_why),
                  rows=rows, skipped=skipped, failed=failed, targets=checks,
                  build_s=bank.build_s, wall_s=wall)
    save_record(record, args.save, f"quantization-{model_label(args.model)}")
    return record


if __name__ == "__main__":
    main()
