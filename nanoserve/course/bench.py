"""Offline throughput: nanoserve against transformers' batched `generate` on the same requests.

A nano-vllm-style workload: N requests with random prompt and output lengths from stated ranges,
ignore_eos (every request produces exactly its output length), fixed seed. Both engines run in one
process, one after the other, and we report output tokens per second and the ratio.

    python -m nanoserve bench [--num-requests 64] [--prompt-len 16 256] [--output-len 16 256]
    python -m nanoserve bench --model qwen2.5-0.5b --num-requests 16    # a real-shape model, random weights
    python -m nanoserve bench --device cuda                              # both engines on the GPU

--model is a model directory or the name of a shipped public config (`models.real_shape_configs()`),
whose random-weight model is written to a temporary directory that both engines load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int = 0):
    """(prompt token ids, output length) per request: lengths uniform in the closed ranges."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = rng.randint(*prompt_len)
        reqs.append(([rng.randrange(vocab) for _ in range(p)], rng.randint(*output_len)))
    return reqs


def run_nanoserve(model_path: str, reqs, max_num_seqs: int, dtype: str = "float32", device: str = "cpu") -> dict:
    from nanoserve import LLM, SamplingParams
    llm = LLM(model_path, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    warm = reqs[:2]
    llm.generate([p for p, _ in warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs), "every request must produce exactly its output length"
    return dict(wall_s=wall, output_tokens=tokens, tokens_per_s=tokens / wall, steps=llm.metrics()["steps"],
                outputs=[o.outputs[0].token_ids for o in outs])


def run_transformers(model_path: str, reqs, batch_size: int, dtype=torch.float32, device: str = "cpu") -> dict:
    """transformers' generate, batched: left-padded prompts, its KV cache, greedy, one call per batch.

    A batch runs until its longest request is done (generate has one max_new_tokens per call);
    only each request's own tokens count as output.
    """
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    pad = 0

    def batch_generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch),
                             min_new_tokens=max(n for _, n in batch), do_sample=False, pad_token_id=pad,
                             eos_token_id=None)
        return [out[i, width:width + n].tolist() for i, (_, n) in enumerate(batch)]

    with torch.inference_mode():
        batch_generate(reqs[:2])  # warm-up
        t0 = time.perf_counter()
        outputs = []
        for i in range(0, len(reqs), batch_size):
            outputs += batch_generate(reqs[i:i + batch_size])
        wall = time.perf_counter() - t0
    tokens = sum(n for _, n in reqs)
    computed = sum(max(n for _, n in reqs[i:i + batch_size]) * len(reqs[i:i + batch_size])
                   for i in range(0, len(reqs), batch_size))
    return dict(wall_s=wall, output_tokens=tokens, tokens_per_s=tokens / wall, batch_size=batch_size,
                decode_slots_computed=computed, outputs=outputs)


def fill_defaults(args, defaults: dict) -> None:
    """Set each option the command line left at None to its default (a benchmark's DEFAULTS, or its QUICK
    sizes under --quick), so that an option given explicitly always wins."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def save_record(record: dict, directory: Path | None, name: str) -> Path | None:
    """Write one run's record as benchmarks/results/<name>-<UTC time>.json (nothing when directory is None)."""
    if not directory:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    f = directory / f"{name}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    f.write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {f}")
    return f


def model_name(path: str) -> str:
    """How a record names the model: "COURSE_MODEL" (or "COURSE_DRAFT_MODEL"), a shipped config's name,
    or the directory's last component; never a path of the machine that ran it."""
    from nanoserve.models.shipped import COURSE_DRAFT_MODEL, COURSE_MODEL, real_shape_configs

    named = {os.path.realpath(COURSE_MODEL): "COURSE_MODEL", os.path.realpath(COURSE_DRAFT_MODEL): "COURSE_DRAFT_MODEL"}
    if str(path) in real_shape_configs():
        return str(path)
    return named.get(os.path.realpath(path), os.path.basename(os.path.normpath(path)))


def machine_info() -> dict:
    import transformers
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__,
                cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None, commit=_commit())


def _commit() -> str | None:
    """The checkout's commit, so a record says what code it measured (NANOSERVE_COMMIT names a copied tree's)."""
    if os.environ.get("NANOSERVE_COMMIT"):
        return os.environ["NANOSERVE_COMMIT"]
    import subprocess
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def main(argv=None) -> dict:
    from nanoserve import COURSE_MODEL
    from nanoserve.models import real_shape_configs, save_random_model
    ap = argparse.ArgumentParser(prog="nanoserve bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=COURSE_MODEL,
                    help=f"model directory, or a shipped config ({', '.join(real_shape_configs())}) with random "
                         "weights (default: the course model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run (default cpu)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' dtype")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64, 16],
                    help="transformers is run at each; the best is the peer's number")
    ap.add_argument("--rounds", type=int, default=2,
                    help="each engine runs once per round, interleaved; each one's best round counts "
                         "(a shared machine's noise hits both, not one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"), help="directory for the JSON record")
    args = ap.parse_args(argv)
    if args.model in real_shape_configs():
        with tempfile.TemporaryDirectory(prefix=f"nanoserve-{args.model}-") as tmp:
            print(f"model: {args.model} (published config, random weights, seed {args.seed}), written to {tmp}")
            save_random_model(args.model, tmp, seed=args.seed)
            return compare(args, tmp)
    return compare(args, args.model)


def compare(args, path: str) -> dict:
    """Both engines on `args`' workload over the model directory `path`; prints and saves the record."""
    from nanoserve import __version__
    from nanoserve.models import ModelConfig
    vocab = ModelConfig.from_path(path).vocab_size
    reqs = make_workload(args.num_requests, args.prompt_len, args.output_len, vocab, args.seed)
    print(f"workload: {len(reqs)} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"output {args.output_len[0]}-{args.output_len[1]} tokens, {sum(n for _, n in reqs)} output tokens")
    ours, peers = None, {}
    for r in range(args.rounds):
        run = run_nanoserve(path, reqs, args.max_num_seqs, args.dtype, args.device)
        print(f"round {r + 1} nanoserve     : {run['tokens_per_s']:8.1f} output tokens/s ({run['wall_s']:.1f} s, "
              f"{run['steps']} steps)")
        ours = run if ours is None or run["tokens_per_s"] > ours["tokens_per_s"] else ours
        for bs in args.hf_batch_sizes:
            run = run_transformers(path, reqs, bs, getattr(torch, args.dtype), args.device)
            print(f"round {r + 1} transformers  : {run['tokens_per_s']:8.1f} output tokens/s ({run['wall_s']:.1f} s, "
                  f"batch {bs})")
            if bs not in peers or run["tokens_per_s"] > peers[bs]["tokens_per_s"]:
                peers[bs] = run
    peers = list(peers.values())
    best = max(peers, key=lambda r: r["tokens_per_s"])
    same = sum(a == b for a, b in zip(ours["outputs"], best["outputs"]))
    ratio = ours["tokens_per_s"] / best["tokens_per_s"]
    print(f"ratio nanoserve / transformers (best batch {best['batch_size']}): {ratio:.2f}x; "
          f"identical greedy outputs: {same}/{len(reqs)}")
    record = dict(
        benchmark="offline", date=datetime.now(timezone.utc).isoformat(timespec="seconds"), nanoserve=__version__,
        machine=machine_info(), model=model_name(args.model), device=args.device, dtype=args.dtype, workload=dict(
            num_requests=len(reqs), prompt_len=list(args.prompt_len), output_len=list(args.output_len),
            seed=args.seed, output_tokens=sum(n for _, n in reqs), rounds=args.rounds),
        nanoserve_result={k: v for k, v in ours.items() if k != "outputs"} | dict(max_num_seqs=args.max_num_seqs),
        transformers_results=[{k: v for k, v in r.items() if k != "outputs"} for r in peers],
        ratio=round(ratio, 3), identical_outputs=same)
    save_record(record, args.save, "offline")
    return record


if __name__ == "__main__":
    main()
