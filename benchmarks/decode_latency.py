"""Decode speed per compilation mode: tokens/s at batch 1 and 8, against transformers' compiled static-cache decode.

Every variant decodes the same prompts for the same number of steps, greedily, in one process:
nanoserve in each compilation mode (eager and compile; on CUDA also cudagraph) and the named peer,
transformers with a StaticCache and `torch.compile` of the model's forward for one-token steps (the
gpt-fast approach as transformers packages it; on CUDA mode="reduce-overhead", i.e. CUDA graphs).
Only decode steps are timed, each ending with a device sync, after a warm-up run over the same
lengths (which pays for compiling: reported apart, as a cost). A variant's number is its median step
over all rounds; the variants run interleaved, round by round, so a noisy neighbour hits all of them.

Reported per (model, batch, variant): median step time, tokens/s, bytes of weights read per second
(gpt-fast's measure: each decode step reads every weight once, whatever the batch; shown only for a
model whose weights do not fit in the last-level cache, where it is memory bandwidth), and ratios
against nanoserve eager and against the peer. The record also says whether every variant produced
nanoserve eager's greedy tokens (in float32 they must agree exactly) and how many graphs were compiled
while timing (must be 0: steady decode recompiles nothing).

Models: COURSE_MODEL (5.4M parameters, fits in cache: launch- and overhead-bound) and a real-shape
model (a shipped public config, seeded random weights written to a temporary directory, nothing
downloaded). Prompt and token counts are chosen so every timed step reads the same block-table width
(prompt 48 + 16 steps = contexts 49..64 = 4 blocks of 16, one width bucket): one graph per batch size.

    python benchmarks/decode_latency.py                       # CPU: both models, batch 1 and 8
    python benchmarks/decode_latency.py --device cuda         # adds cudagraph
    python benchmarks/decode_latency.py --models COURSE_MODEL --batch-sizes 1 --modes eager compile
    python benchmarks/decode_latency.py --quick               # a tiny smoke run (the test's)

Compile seconds are what this launch paid: with inductor's on-disk caches warm (a second launch)
most of it is skipped; --cold-compile turns those caches off to measure a first launch.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

# Run as a script, this folder comes first on sys.path, and benchmarks/kernels.py would shadow the
# `kernels` package that transformers looks for: imports resolve from the repository, not from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from nanoserve import COURSE_DRAFT_MODEL, COURSE_MODEL, LLM, SamplingParams, models  # noqa: E402
from nanoserve.course.bench import fill_defaults, machine_info, save_record  # noqa: E402
from nanoserve.engine.compiled_decode import width_bucket  # noqa: E402
from nanoserve.perf import measure_ceilings, sync  # noqa: E402

PEER = "transformers"
ENGINE_MODES = {"cpu": ["eager", "compile"], "cuda": ["eager", "compile", "cudagraph"]}
COURSE_MODELS = {"COURSE_MODEL": COURSE_MODEL, "COURSE_DRAFT_MODEL": COURSE_DRAFT_MODEL}
DEFAULTS = dict(models=["COURSE_MODEL", "qwen2.5-0.5b"], batch_sizes=[1, 8], prompt=48, tokens=16, rounds=3)
QUICK = dict(models=["COURSE_DRAFT_MODEL"], batch_sizes=[1], prompt=8, tokens=8, rounds=1)


class EngineVariant:
    """nanoserve in one compilation mode; one LLM serves every batch size (max_num_seqs = the largest)."""

    def __init__(self, path: str, mode: str, args):
        self.name, self.device = mode, torch.device(args.device)
        max_batch, max_len = max(args.batch_sizes), args.prompt + args.tokens + 1
        t0 = time.perf_counter()
        self.llm = LLM(model=path, device=args.device, dtype=args.dtype, max_num_seqs=max_batch,
                       max_num_batched_tokens=max(2048, max_batch * args.prompt),   # every prefill in one step
                       max_model_len=max_len, block_size=args.block_size,
                       # a pool of exactly what the run needs: nothing sized from free memory, which
                       # the variants built before this one have taken
                       num_kv_blocks=max_batch * -(-max_len // args.block_size),
                       enable_prefix_caching=False,   # every round prefills the same prompts afresh
                       compilation=mode)
        self.build_s = time.perf_counter() - t0
        self.ids = itertools.count()

    def run(self, prompts: list[list[int]], tokens: int) -> tuple[list[float], list[list[int]]]:
        """Prefill `prompts` in one step, then time `tokens` decode steps: (step seconds, tokens per prompt)."""
        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
        ids = [str(next(self.ids)) for _ in prompts]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        last = {o.request_id: o for o in engine.step()}            # the prefill, untimed
        if len(last) != len(prompts):
            raise RuntimeError(f"the prefill took more than one step ({len(last)} of {len(prompts)} prompts)")
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            outs = engine.step()
            sync(self.device)                                      # the step ends when the device is done
            times.append(time.perf_counter() - t0)
            if len(outs) != len(prompts):                          # a timed step decodes the whole batch
                raise RuntimeError(f"a decode step advanced {len(outs)} of {len(prompts)} sequences")
            last.update((o.request_id, o) for o in outs)
        return times, [list(last[rid].outputs[0].token_ids) for rid in ids]

    def info(self) -> dict:
        m = self.llm.metrics()
        return dict(build_s=self.build_s, num_compiles=m["num_compiles"], num_recompiles=m["num_recompiles"],
                    cudagraph_capture_s=m.get("cudagraph_capture_seconds"),
                    cudagraph_memory_bytes=m.get("cudagraph_memory_bytes"))


class PeerVariant:
    """transformers' compiled static-cache decode: prefill eager, then one-token forwards of the compiled
    model, greedy argmax. One StaticCache per batch size, reset (in place: the compiled graph holds its
    addresses) before each run."""

    def __init__(self, path: str, args):
        from transformers import AutoModelForCausalLM, CompileConfig
        self.name, self.device = PEER, torch.device(args.device)
        self.max_len = args.prompt + args.tokens + 1
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        self.model = self.model.to(self.device).eval()
        # static shapes, one graph for the whole step; CUDA graphs on a GPU (transformers' default mode)
        self.compile_config = CompileConfig(fullgraph=True, dynamic=False,
                                            mode="reduce-overhead" if self.device.type == "cuda" else "default")
        self.step = self.model.get_compiled_call(self.compile_config)
        # the forward's cache argument: `past_key_values` until transformers 5.2x renamed it `cache`
        forward_args = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self.build_s = time.perf_counter() - t0
        self.caches = {}

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], tokens: int) -> tuple[list[float], list[list[int]]]:
        from transformers import StaticCache
        B, P, dev = len(prompts), len(prompts[0]), self.device
        cache = self.caches.get(B)
        if cache is None:
            cache = self.caches[B] = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        else:
            cache.reset()
        ids = torch.tensor(prompts, device=dev)
        logits = self.model(input_ids=ids, position_ids=torch.arange(P, device=dev).expand(B, P),
                            **{self.cache_arg: cache}, use_cache=True, logits_to_keep=1).logits   # prefill, eager
        tok = logits[:, -1:].argmax(-1)
        out, times = [tok], []
        sync(dev)
        for i in range(tokens):
            t0 = time.perf_counter()
            logits = self.step(input_ids=tok, position_ids=torch.full((B, 1), P + i, device=dev),
                               **{self.cache_arg: cache}, use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            sync(dev)
            times.append(time.perf_counter() - t0)
            out.append(tok)
        return times, torch.cat(out, 1).tolist()

    def info(self) -> dict:
        return dict(build_s=self.build_s, attn_implementation=self.model.config._attn_implementation,
                    compile_config=self.compile_config.to_dict())


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process, every torch.compile'd function counted (engine and peer)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def last_level_cache_bytes(device: torch.device) -> int | None:
    """The GPU's L2, or the CPU's highest cache level (Linux's sysfs); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        n = int(size.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best or (0, 0), (level, n))
    return best[1] if best else None


def unique_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters, a tied embedding and head counted once (what one decode step reads)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n random prompts (token 0 left out: it is the course model's eos); batch b uses the first b."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def measure_model(name: str, path: str, args) -> tuple[dict, list[dict]]:
    """Every variant on one model, every batch size: (the model's setup record, one row per (batch, variant))."""
    cfg = models.ModelConfig.from_path(path)
    if args.prompt + args.tokens + 1 > cfg.max_position_embeddings:
        raise SystemExit(f"error: --prompt {args.prompt} + --tokens {args.tokens} exceeds {name}'s "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    print(f"\n{name}: building {', '.join(args.modes)}")
    variants = [EngineVariant(path, m, args) if m != PEER else PeerVariant(path, args) for m in args.modes]
    weights = (variants[0].llm.metrics()["weight_bytes"] if isinstance(variants[0], EngineVariant)
               else unique_weight_bytes(variants[0].model))
    llc = last_level_cache_bytes(torch.device(args.device))
    exceeds_cache = llc is None or weights > llc
    # the floor a step cannot beat when its weights stream from memory: weight bytes / copy bandwidth
    # (measure_ceilings' number, measured once in this process)
    bandwidth = measure_ceilings(device=args.device).mem_bw if exceeds_cache else None
    prompts = make_prompts(max(args.batch_sizes), args.prompt, cfg.vocab_size, args.seed)
    rows = []
    for batch in args.batch_sizes:
        batch_prompts = prompts[:batch]
        warm = {}
        for v in variants:   # warm-up over the same lengths: compiles every graph the timed runs use
            t0 = time.perf_counter()
            warm[v.name] = v.run(batch_prompts, args.tokens)[0]
            print(f"  batch {batch}: {v.name} warmed up in {time.perf_counter() - t0:.1f} s")
        before = graphs_compiled()
        times = {v.name: [] for v in variants}
        tokens = {}
        for r in range(args.rounds):
            k = r % len(variants)   # a different variant goes first each round
            for v in variants[k:] + variants[:k]:
                t, tokens[v.name] = v.run(batch_prompts, args.tokens)
                times[v.name] += t
        compiled_while_timing = graphs_compiled() - before
        median = {n: statistics.median(t) for n, t in times.items()}
        for v in variants:
            step = median[v.name]
            # the warm-up's decode steps beyond steady speed: what compiling (or the first use) cost
            extra = sum(warm[v.name]) - len(warm[v.name]) * step
            row = dict(model=name, batch=batch, variant=v.name, median_step_s=step, tokens_per_s=batch / step,
                       weight_bytes_per_s=weights / step, steps=len(times[v.name]),
                       bandwidth_utilisation=weights / step / bandwidth if bandwidth else None,
                       ratio_vs_eager=median["eager"] / step if "eager" in median else None,
                       ratio_vs_peer=median[PEER] / step if PEER in median else None,
                       warmup_extra_s=extra, graphs_compiled_while_timing=compiled_while_timing,
                       same_tokens_as_eager=tokens[v.name] == tokens["eager"] if "eager" in tokens else None)
            rows.append(row)
    setup = dict(model=name, parameters=cfg.num_parameters, weight_bytes=weights, last_level_cache_bytes=llc,
                 weights_exceed_cache=exceeds_cache, memory_bytes_per_s=bandwidth,
                 variants={v.name: v.info() for v in variants})
    return setup, rows


HEADER = (f"{'model':<20} {'batch':>5} {'mode':<12} {'step ms':>9} {'tokens/s':>10} {'weights GB/s':>12} "
          f"{'vs eager':>9} {'vs ' + PEER:>16} {'compile s':>9}")


def print_row(row: dict, exceeds_cache: bool) -> None:
    """One line of the table; weight GB/s only where the weights stream from memory, not from a cache."""
    def ratio(x):
        return f"{x:.2f}x" if x is not None else "-"
    gbps = f"{row['weight_bytes_per_s'] / 1e9:.2f}" if exceeds_cache else "(in cache)"
    extra = f"{row['warmup_extra_s']:.1f}" if row["variant"] != "eager" else "-"
    print(f"{row['model']:<20} {row['batch']:>5} {row['variant']:<12} {row['median_step_s'] * 1e3:>9.2f} "
          f"{row['tokens_per_s']:>10.1f} {gbps:>12} {ratio(row['ratio_vs_eager']):>9} "
          f"{ratio(row['ratio_vs_peer']):>16} {extra:>9}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = list(COURSE_MODELS) + models.real_shape_configs()
    ap.add_argument("--models", nargs="+", choices=choices, metavar="MODEL",
                    help=f"models, in order (default: {' '.join(DEFAULTS['models'])}); one of {', '.join(choices)}; "
                         "a shipped config name means its published shape with random weights")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="every variant's dtype (greedy tokens agree exactly only in float32)")
    ap.add_argument("--modes", nargs="+", metavar="MODE",
                    help=f"variants to run: nanoserve's compilation modes and {PEER!r} "
                         f"(default: {' '.join(ENGINE_MODES['cpu'])} {PEER} on a CPU, plus cudagraph on CUDA)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", help=f"(default: {DEFAULTS['batch_sizes']})")
    ap.add_argument("--prompt", type=int, help=f"prompt tokens (default: {DEFAULTS['prompt']})")
    ap.add_argument("--tokens", type=int, help=f"decode steps timed per round (default: {DEFAULTS['tokens']})")
    ap.add_argument("--rounds", type=int, help=f"timed runs per variant, interleaved (default: {DEFAULTS['rounds']})")
    ap.add_argument("--block-size", type=int, default=16, help="nanoserve's KV block size")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ap.add_argument("--threads", type=int, default=cores,
                    help="torch threads (default: every core this process may use)")
    ap.add_argument("--seed", type=int, default=0, help="prompts and random weights")
    ap.add_argument("--cold-compile", action="store_true",
                    help="turn inductor's on-disk caches off, so compile seconds are a first launch's")
    ap.add_argument("--quick", action="store_true",
                    help=f"a tiny smoke run: {QUICK} unless given; its numbers mean nothing")
    ap.add_argument("--save", type=lambda s: Path(s) if s else None, default=Path("benchmarks/results"),
                    help="directory for the JSON record ('' saves none)")
    args = ap.parse_args(argv)
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    engine_modes = ENGINE_MODES[args.device]
    args.modes = list(dict.fromkeys(args.modes or engine_modes + [PEER]))   # in order, once each
    for m in args.modes:
        if m not in engine_modes + [PEER]:
            hint = " (CUDA graphs need --device cuda)" if m == "cudagraph" else ""
            ap.error(f"--modes {m!r}: expected some of {', '.join(engine_modes + [PEER])} on {args.device}{hint}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    for key in ("batch_sizes", "prompt", "tokens", "rounds", "block_size", "threads"):
        values = getattr(args, key)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            ap.error(f"--{key.replace('_', '-')} must be at least 1, got {values}")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cold_compile:
        from torch._inductor import config as inductor_config
        inductor_config.force_disable_caches = True
    started = time.perf_counter()
    print(f"decode latency on {args.device}, {args.dtype}, {args.threads} threads: prompt {args.prompt}, "
          f"{args.tokens} decode steps x {args.rounds} rounds, batch {args.batch_sizes}, variants {args.modes}")
    # compile mode has a graph per block-table width: say so when the timed contexts need more than one
    # (the warm-up compiles them all the same; only the step's cost changes mid-run)
    widths = {width_bucket(-(-c // args.block_size)) for c in range(args.prompt + 1, args.prompt + args.tokens + 1)}
    if len(widths) > 1:
        print(f"note: the timed contexts span block-table widths {sorted(widths)}: one graph per width")
    setups, rows = [], []
    for name in args.models:
        if name in COURSE_MODELS:
            setup, model_rows = measure_model(name, COURSE_MODELS[name], args)
        else:
            with tempfile.TemporaryDirectory(prefix=f"nanoserve-{name}-") as tmp:
                models.save_random_model(name, tmp, dtype=getattr(torch, args.dtype), seed=args.seed)
                setup, model_rows = measure_model(name, tmp, args)
        setups.append(setup)
        rows += model_rows
        gc.collect()   # the model's variants go before the next model's are built
    wall = time.perf_counter() - started

    print("\n" + HEADER)
    exceeds_cache = {s["model"]: s["weights_exceed_cache"] for s in setups}
    for row in rows:
        print_row(row, exceeds_cache[row["model"]])
    print("compile s: the warm-up's decode time beyond steady speed (compiling the graphs it used); "
          f"inductor caches {'off' if args.cold_compile else 'on (warm caches hide most of it)'}")
    for s in setups:
        if s["memory_bytes_per_s"]:
            print(f"{s['model']}: {s['weight_bytes'] / 1e9:.2f} GB of weights per step over "
                  f"{s['memory_bytes_per_s'] / 1e9:.1f} GB/s measured copy bandwidth: a floor of "
                  f"{s['weight_bytes'] / s['memory_bytes_per_s'] * 1e3:.1f} ms per step")
        capture = s["variants"].get("cudagraph", {}).get("cudagraph_capture_s")
        if capture is not None:
            print(f"{s['model']}: cudagraph capture at start {capture:.2f} s")
    agree = {}   # model -> variant -> same greedy tokens as eager at every batch size
    for row in rows:
        if row["same_tokens_as_eager"] is not None:
            by_variant = agree.setdefault(row["model"], {})
            by_variant[row["variant"]] = by_variant.get(row["variant"], True) and row["same_tokens_as_eager"]
    for model, by_variant in agree.items():
        differ = [v for v, same in by_variant.items() if not same]
        print(f"{model}: greedy tokens " + (f"DIFFER from eager's: {', '.join(differ)}" if differ
                                           else "identical to eager's for every variant"))
    compiled = sum({(r["model"], r["batch"]): r["graphs_compiled_while_timing"] for r in rows}.values())
    recompiles = {f"{s['model']}/{v}": i["num_recompiles"] for s in setups for v, i in s["variants"].items()
                  if "num_recompiles" in i}
    print(f"graphs compiled while timing: {compiled}; nanoserve recompiles: {sum(recompiles.values())}; "
          f"wall {wall:.0f} s")

    record = dict(benchmark="decode_latency", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), device=args.device, dtype=args.dtype, threads=args.threads,
                  args=dict(models=args.models, modes=args.modes,
                            batch_sizes=args.batch_sizes, prompt=args.prompt, tokens=args.tokens,
                            rounds=args.rounds, block_size=args.block_size, seed=args.seed,
                            cold_compile=args.cold_compile, quick=args.quick),
                  peer=dict(name=PEER, what="transformers StaticCache + torch.compile of the model's forward, "
                                            "one-token steps, greedy argmax"),
                  models=setups, rows=rows, tokens_agree_with_eager=agree,
                  graphs_compiled_while_timing=compiled, num_recompiles=recompiles, wall_s=wall)
    save_record(record, args.save, "decode_latency")
    return record


if __name__ == "__main__":
    main()
