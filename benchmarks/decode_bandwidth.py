"""Batch-1 decode: how close does the engine get to the memory bandwidth of this machine?

At batch 1 every decode step reads every weight once and does ~2 FLOPs per weight: the step is
memory-bound, so the right measure is bytes read per second against what the memory can deliver
(memory bandwidth utilisation, as gpt-fast reports it). The model is a random-weight model with a
real architecture (Qwen2.5-0.5B's shapes, 494M parameters): far larger than any CPU's last-level cache,
so its weights must stream from DRAM every token. Nothing is downloaded.

    python benchmarks/decode_bandwidth.py [--tokens 32] [--dtype float32]
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from nanoserve.course.bench import machine_info, save_record
from nanoserve.engine import EngineConfig, LLMEngine
from nanoserve.models import CausalLM, ModelConfig
from nanoserve.perf import measure_ceilings, timeit
from nanoserve.sampling import SamplingParams

QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B config.json, as published
    architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def random_model(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    return model.eval()


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of summing a buffer far larger than the caches (a pure read stream)."""
    x = torch.ones(nbytes // 4)
    return nbytes / timeit(x.sum, warmup=1, repeat=5).min_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig.from_dict(QWEN25_05B, "Qwen2.5-0.5B shapes")
    model = random_model(cfg, dtype)
    elem = torch.finfo(dtype).bits // 8
    weight_bytes = cfg.num_parameters * elem  # the tied head reads the whole embedding; the lookup one row
    max_len = args.prompt + args.tokens + 8
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=1, max_model_len=max_len, num_kv_blocks=-(-max_len // 16)))
    engine.add_request(list(range(1, args.prompt + 1)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():  # warm-up run
        engine.step()
    engine.add_request(list(range(1, args.prompt + 1)),
                       SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    ctx = args.prompt + args.tokens / 2
    kv_bytes = ctx * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    bytes_per_token = weight_bytes + kv_bytes
    achieved = bytes_per_token / step_s
    copy_bw = measure_ceilings(force=True).mem_bw
    read_bw = read_bandwidth()
    peak = max(copy_bw, read_bw)
    print(f"model: Qwen2.5-0.5B shapes, {cfg.num_parameters / 1e6:.0f}M parameters, {args.dtype}, "
          f"{bytes_per_token / 1e9:.2f} GB read per token")
    print(f"decode: {1 / step_s:.2f} tokens/s (median step {step_s * 1e3:.0f} ms over {len(times)} steps)")
    print(f"achieved {achieved / 1e9:.2f} GB/s; measured memory bandwidth: copy {copy_bw / 1e9:.2f} GB/s, "
          f"read {read_bw / 1e9:.2f} GB/s")
    print(f"memory bandwidth utilisation: {achieved / peak:.0%} of the better of the two")
    record = dict(benchmark="decode_bandwidth", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), model="random weights, Qwen2.5-0.5B config", dtype=args.dtype,
                  parameters=cfg.num_parameters, bytes_per_token=bytes_per_token, median_step_s=step_s,
                  tokens_per_s=1 / step_s, achieved_bytes_per_s=achieved, copy_bytes_per_s=copy_bw,
                  read_bytes_per_s=read_bw, utilisation=round(achieved / peak, 3), steps=len(times))
    save_record(record, args.save, f"decode_bandwidth-{args.dtype}")
    return record


if __name__ == "__main__":
    main()
