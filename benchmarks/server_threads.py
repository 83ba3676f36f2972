"""Server threads on a CPU: the forward's intra-op threads against the cores the serving front end needs.

On a CPU the server's forward runs on a team of intra-op threads (torch's default: one per core), while the event
loop (HTTP, JSON, a frame per streamed token) and, on one machine, the load client need cores too. This runs two
servers side by side, the same model and flags, one with OMP_NUM_THREADS=1 and one with a thread per core, and
loads them in turns (round by round, the order alternating, so a shared machine's slow moments fall on both) with
two workloads:

    decode-heavy   16 streams, 128-token prompts that every round repeats (the prefix cache holds them), 64 out
    prefill-heavy  4 streams, 512-token prompts new to every run, 16 out, no prefix cache

Recorded per workload and server: output tokens/s, median TTFT and median TPOT of every round, their medians, and
the ratio one thread / a thread per core. Printed, never asserted: which setting wins depends on the workload and
the machine (the cores, and whether the client shares them), which is what the record shows.

    python benchmarks/server_threads.py                    # 4 rounds of each workload: about two minutes
    python benchmarks/server_threads.py --rounds 2 --model DIR
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]   # benchmarks/kernels.py shadows kernels

from nanoserve.course.bench import machine_info, model_name, save_record  # noqa: E402
from nanoserve.ports import free_port  # noqa: E402
from nanoserve.serve.load import corpus_prompts, run_load, start_servers  # noqa: E402

# name: (streams, prompt tokens, output tokens, prompts repeat across rounds, server flags)
WORKLOADS = {"decode-heavy": (16, 128, 64, True, []),
             "prefill-heavy": (4, 512, 16, False, ["--no-enable-prefix-caching"])}
SERVED = "bench"


def settings(cores: int) -> dict[str, str]:
    """OMP_NUM_THREADS of each server: one, and one per core."""
    return {"1 thread": "1", f"{cores} threads": str(cores)}


def summary(runs: list[dict]) -> dict:
    """Per-round numbers of one server on one workload, and their medians."""
    keys = {"tokens_per_s": "output_throughput", "median_ttft_ms": "median_ttft_ms", "median_tpot_ms": "median_tpot_ms"}
    rounds = {k: [round(r[src], 3) for r in runs] for k, src in keys.items()}
    return dict(rounds=rounds, **{k: statistics.median(v) for k, v in rounds.items()},
                failed=sum(r["failed"] for r in runs))


async def measure(model: str | None, rounds: int, cores: int, timeout_s: float) -> dict:
    results = {}
    for name, (streams, prompt_len, out_len, repeat, flags) in WORKLOADS.items():
        env = settings(cores)
        base = [sys.executable, "-m", "nanoserve", "serve", "--device", "cpu", "--served-model-name", SERVED,
                "--max-num-seqs", str(max(streams, 4)), *(["--model", model] if model else []), *flags]
        servers = [(base + ["--port", str(port := free_port())], port, dict(os.environ, OMP_NUM_THREADS=threads))
                   for threads in env.values()]
        # every run's prompts: the same set each round where they repeat, else a window of their own
        needed = 2 * streams * (1 if repeat else 2 * rounds + 1)
        prompts = corpus_prompts(needed, prompt_len, seed=7, model=model)
        runs: dict[str, list[dict]] = {label: [] for label in env}
        with start_servers(servers, timeout_s=180) as urls:
            by_label = dict(zip(env, urls))
            for label, url in by_label.items():    # warm-up: first requests pay one-off costs
                await run_load(url, SERVED, prompts[-2:], max_tokens=4, timeout_s=timeout_s)
            for r in range(rounds):
                order = list(by_label.items()) if r % 2 == 0 else list(by_label.items())[::-1]
                for k, (label, url) in enumerate(order):
                    at = 0 if repeat else (2 * r + k) * 2 * streams
                    runs[label].append(await run_load(url, SERVED, prompts[at:at + 2 * streams], max_tokens=out_len,
                                                      max_concurrency=streams, timeout_s=timeout_s))
        rows = {label: summary(v) for label, v in runs.items()}
        one, many = rows.values()
        results[name] = dict(streams=streams, prompt_tokens=prompt_len, output_tokens=out_len,
                             prompts_repeat=repeat, server_flags=flags, servers=rows,
                             one_over_many_tokens_per_s=one["tokens_per_s"] / many["tokens_per_s"])
        print(f"{name:13s} {streams} streams, {prompt_len} in / {out_len} out: " + "; ".join(
            f"{label} {r['tokens_per_s']:.0f} tok/s, TTFT {r['median_ttft_ms']:.1f} ms, TPOT {r['median_tpot_ms']:.2f} ms"
            for label, r in rows.items()) + f"; tokens/s one / many {results[name]['one_over_many_tokens_per_s']:.2f}x",
            flush=True)
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face-format directory (default: the course model)")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each workload per server, in turns")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take before it fails")
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"), help="directory for the JSON record")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: expected at least 1")
    cores = os.cpu_count() or 1
    if cores < 2:
        raise SystemExit("server_threads.py compares one intra-op thread with one per core: this machine has one core")
    t0 = time.perf_counter()
    workloads = asyncio.run(measure(args.model, args.rounds, cores, args.timeout))
    record = dict(benchmark="server_threads", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), model=model_name(args.model) if args.model else "COURSE_MODEL",
                  settings=settings(cores), rounds=args.rounds, workloads=workloads,
                  wall_s=round(time.perf_counter() - t0, 1))
    save_record(record, args.save, "server_threads")
    return record


if __name__ == "__main__":
    main()
