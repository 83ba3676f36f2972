"""Batch-1 decode: how close does the engine get to the memory bandwidth of this machine?

At batch 1 every decode step reads every weight once and does ~2 FLOPs per weight: the step is
memory-bound, so the right measure is bytes read per second against what the memory can deliver
(memory bandwidth utilisation, as gpt-fast reports it). The model is a random-weight model with a
real architecture (by default Qwen2.5-0.5B's published config, 494M parameters): far larger than any
CPU's last-level cache, so its weights must stream from DRAM every token. Nothing is downloaded.

    python benchmarks/decode_bandwidth.py [--tokens 32] [--dtype float32] [--model qwen2.5-0.5b] [--device cpu]
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from nanoserve import models
from nanoserve.course.bench import machine_info, save_record
from nanoserve.engine import EngineConfig, LLMEngine
from nanoserve.engine.compiled_decode import resolve_mode
from nanoserve.perf import measure_ceilings, sync, timeit
from nanoserve.sampling import SamplingParams


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of summing a buffer far larger than the caches (a pure read stream)."""
    x = torch.ones(nbytes // 4, device=device)
    return nbytes / timeit(x.sum, warmup=1, repeat=5, device=device).min_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=models.real_shape_configs(),
                    help="shipped public config, random weights")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    model = models.random_model(args.model, dtype=dtype, device=device)
    cfg = model.config
    elem = torch.finfo(dtype).bits // 8
    weight_bytes = cfg.num_parameters * elem  # the tied head reads the whole embedding; the lookup one row
    max_len = args.prompt + args.tokens + 8
    # the engine as LLM runs it on this device: CUDA graphs on a GPU (eager, it is launch-bound there)
    mode = resolve_mode(None, False, device)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=1, max_model_len=max_len, num_kv_blocks=-(-max_len // 16),
                                                 compilation=mode))
    engine.add_request("warm-up", list(range(1, args.prompt + 1)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():  # warm-up run
        engine.step()
    engine.add_request("timed", list(range(1, args.prompt + 1)),
                       SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        sync(device)   # the step ends when the device has finished it
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    ctx = args.prompt + args.tokens / 2
    kv_bytes = ctx * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    bytes_per_token = weight_bytes + kv_bytes
    achieved = bytes_per_token / step_s
    copy_bw = measure_ceilings(force=True, device=device).mem_bw
    read_bw = read_bandwidth(device)
    peak = max(copy_bw, read_bw)
    print(f"model: {args.model} (random weights), {cfg.num_parameters / 1e6:.0f}M parameters, {args.dtype}, "
          f"{bytes_per_token / 1e9:.2f} GB read per token")
    print(f"decode ({mode}): {1 / step_s:.2f} tokens/s (median step {step_s * 1e3:.2f} ms over {len(times)} steps)")
    print(f"achieved {achieved / 1e9:.2f} GB/s; measured memory bandwidth: copy {copy_bw / 1e9:.2f} GB/s, "
          f"read {read_bw / 1e9:.2f} GB/s")
    print(f"memory bandwidth utilisation: {achieved / peak:.0%} of the better of the two")
    record = dict(benchmark="decode_bandwidth", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), model=args.model, weights="random", device=args.device, dtype=args.dtype,
                  compilation=mode, parameters=cfg.num_parameters, bytes_per_token=bytes_per_token, median_step_s=step_s,
                  tokens_per_s=1 / step_s, achieved_bytes_per_s=achieved, copy_bytes_per_s=copy_bw,
                  read_bytes_per_s=read_bw, utilisation=round(achieved / peak, 3), steps=len(times))
    save_record(record, args.save, f"decode_bandwidth-{args.dtype}")
    return record


if __name__ == "__main__":
    main()
