"""Serving: the throughput-latency curve of our server against a naive transformers server, over a sweep of
request rates, and the highest rate each sustains under a TTFT SLO.

A server is judged by the load it can take while its users still get their first token in time. This runs
both servers as subprocesses on loopback ports, the same model (the course model by default) on the same
CPU, and loads each with the same requests (prompts cut from the course corpus, ignore_eos, greedy) arriving
as a Poisson process (`nanoserve.serve.load`, vLLM's `bench serve` definitions), at each rate of the sweep:

    ours    python -m nanoserve serve --max-num-seqs 32     continuous batching over a paged KV cache
    peer    python -m nanoserve.serve.naive                 transformers' generate, one request at a time

Per rate and server it reports the achieved request throughput, output tokens/s, p50 and p99 TTFT, p99 TPOT
and failures; then, for the SLO (p99 TTFT <= --slo-ttft-ms, and no failed request), the highest swept rate
each sustains and the ratio ours / peer (target: >= 3x, printed as PASS / FAIL, never asserted).

Honest comparison: one server is under load at a time (both stay up; the idle one waits on a socket), and the
order alternates from rate to rate, so slow drift of a shared machine hits both. Every rate gets prompts of its
own, disjoint windows of the corpus, so our prefix cache gains nothing from the sweep repeating itself.
Each server is warmed up first with a few requests. A server that misses the SLO at --stop-after rates in a row
is not loaded at higher rates (its queue only grows; the knee is already on the curve). The load client runs
in this process and takes CPU from the server on a 2-core machine alike for both: the ratio holds better than
the absolute numbers.

    python benchmarks/serving.py                          # rates 1 .. 16 req/s, 15 s of arrivals each
    python benchmarks/serving.py --rates 1 2 4 8 --duration 30 --slo-ttft-ms 500
    python benchmarks/serving.py --quick                  # three rates, a few seconds each: under a minute

--clients runs third-party load clients instead of the sweep: our server alone, loaded in turn by our own client,
guidellm and aiperf (`nanoserve.serve.clients`) with the same load (--requests at --concurrency in flight,
--input-len prompt tokens, exactly --output-len out), and records their TTFT, ITL and throughput side by side with
each tool's ratio to ours and PASS / FAIL against the band `clients.BAND` (printed, never asserted):

    python benchmarks/serving.py --clients                # 96 requests, 4 in flight, 128 in, 32 out: about a minute
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

# Run as a script, this folder comes first on sys.path, and benchmarks/kernels.py would shadow the
# `kernels` package that transformers looks for: imports resolve from the repository, not from here.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from nanoserve.course.bench import fill_defaults, machine_info, model_name, save_record  # noqa: E402
from nanoserve.ports import free_port  # noqa: E402
from nanoserve.serve.load import corpus_prompts, load, start_server  # noqa: E402

SERVED_NAME = "bench"
TARGET = 3.0   # ours / peer, in sustained request rate
DEFAULTS = dict(rates=[1, 1.5, 2, 3, 4, 6, 8, 12, 16], duration=15.0, min_prompts=16, input_len=128, output_len=64,
                stop_after=2)
QUICK = dict(rates=[1, 4, 12], duration=4.0, min_prompts=6, input_len=128, output_len=32, stop_after=1)
WARMUP_PROMPTS = 4
CLIENTS = dict(requests=96, concurrency=4, input_len=128, output_len=32)


def server_commands(model: str | None, max_num_seqs: int) -> dict[str, callable]:
    """Each server's command line, given its port. Both on the CPU, float32, serving the same name."""
    py, model_args = sys.executable, (["--model", model] if model else [])
    common = lambda port: [*model_args, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    return {"ours": lambda port: [py, "-m", "nanoserve", "serve", "--device", "cpu", "--dtype", "float32",
                                  "--max-num-seqs", str(max_num_seqs), *common(port)],
            "peer": lambda port: [py, "-m", "nanoserve.serve.naive", *common(port)]}


def meets_slo(s: dict, slo_ttft_ms: float) -> bool:
    return s["failed"] == 0 and s["completed"] > 0 and s["p99_ttft_ms"] <= slo_ttft_ms


def sweep(urls: dict[str, str], prompt_sets: list[list[str]], rates: list[float], args) -> dict[str, list[dict]]:
    """Every server at every rate (one at a time, alternating which goes first); rows of each server's curve."""
    rows = {name: [] for name in urls}
    misses = {name: 0 for name in urls}
    print(f"{'rate':>6} {'server':>6} {'req/s':>7} {'tok/s':>8} {'p50 TTFT':>10} {'p99 TTFT':>10} {'p99 TPOT':>9} "
          f"{'failed':>6}  SLO")
    for i, (rate, prompts) in enumerate(zip(rates, prompt_sets)):
        for name in (list(urls) if i % 2 == 0 else list(reversed(urls))):
            if misses[name] >= args.stop_after:
                continue
            s = load(urls[name], SERVED_NAME, prompts, max_tokens=args.output_len, request_rate=rate,
                     burstiness=args.burstiness, seed=args.seed + i, timeout_s=args.timeout)
            ok = meets_slo(s, args.slo_ttft_ms)
            misses[name] = 0 if ok else misses[name] + 1
            rows[name].append({k: v for k, v in s.items() if k != "requests"} | dict(meets_slo=ok))
            print(f"{rate:>6g} {name:>6} {s['request_throughput']:>7.2f} {s['output_throughput']:>8.1f} "
                  f"{s['median_ttft_ms']:>8.0f}ms {s['p99_ttft_ms']:>8.0f}ms {s['p99_tpot_ms']:>7.1f}ms "
                  f"{s['failed']:>6}  {'ok' if ok else 'miss'}" + (f"  ({s['errors'][0]})" if s["errors"] else ""))
    return rows


def sustained(rows: list[dict]) -> float:
    """The highest swept rate that met the SLO (0 when none did)."""
    return max((r["request_rate"] for r in rows if r["meets_slo"]), default=0.0)


def run_clients(args) -> dict:
    """--clients: ours, guidellm and aiperf under one load against our server; the record of their rows."""
    from importlib.metadata import version

    from nanoserve import COURSE_MODEL, __version__
    from nanoserve.serve import clients
    tokenizer_dir = Path(args.model or COURSE_MODEL)
    if not (tokenizer_dir / "tokenizer.json").exists():
        raise SystemExit(f"--clients needs a model directory with its tokenizer (the tools cut prompts with it): "
                         f"{tokenizer_dir} has no tokenizer.json")
    load_ = clients.Load(args.requests, args.concurrency, args.input_len, args.output_len)
    command = server_commands(args.model, args.max_num_seqs)["ours"]
    print(f"model {model_name(args.model) if args.model else 'COURSE_MODEL'}; each client: {load_.requests} requests, "
          f"{load_.concurrency} in flight, {load_.input_tokens} prompt tokens, {load_.output_tokens} output tokens")
    t0, port = time.perf_counter(), free_port()
    with start_server(command(port), port, timeout_s=180) as url:
        result = clients.compare(url, load_, model=SERVED_NAME, tokenizer_dir=tokenizer_dir, timeout_s=args.timeout,
                                 warmup_requests=WARMUP_PROMPTS)
    wall = time.perf_counter() - t0
    print(clients.format_rows(result))
    verdict = {tool: "PASS" if ok else "FAIL" for tool, ok in result["agree"].items()}
    band = ", ".join(f"{k} {lo:g}x-{hi:g}x" for k, (lo, hi) in result["band"].items())
    print(f"band ({band}), no failure, every output {load_.output_tokens} tokens: "
          + ", ".join(f"{tool} {v}" for tool, v in verdict.items()) + f"\nwall time {wall:.0f} s")
    shown = model_name(args.model) if args.model else "COURSE_MODEL"   # a record names no path of this machine
    commands = {tool: c.replace(f":{port}", ":PORT").replace(str(tokenizer_dir.resolve()), shown)
                for tool, c in result["commands"].items()}
    record = dict(benchmark="serving_clients", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  nanoserve=__version__, machine=machine_info(), model=shown,
                  tools={tool: version(tool) for tool in clients.TOOLS},
                  server=" ".join(command(0)[1:]).replace("--port 0", "--port PORT"), commands=commands,
                  load=result["load"], warmup_requests=WARMUP_PROMPTS, rows=result["rows"],
                  ratios=result["ratios"], band=result["band"], verdict=verdict, wall_s=round(wall, 1))
    # not "serving-...": chapter 09 shows the newest "serving-*.json" as the sweep's record
    save_record(record, args.save, "serving_clients")
    return record


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Hugging Face-format directory (default: the course model)")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="requests/s to sweep, ascending")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (prompts = rate x this)")
    ap.add_argument("--min-prompts", type=int, default=None, help="requests per rate at least")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens per request (ignore_eos)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="the p99 TTFT a sustained rate must meet")
    ap.add_argument("--stop-after", type=int, default=None, help="SLO misses in a row before a server's sweep ends")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="our server's batch")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take before it fails")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a test-size sweep (under a minute)")
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"), help="directory for the JSON record")
    ap.add_argument("--clients", action="store_true", help="guidellm and aiperf beside our client (no sweep)")
    ap.add_argument("--requests", type=int, default=None, help="--clients: requests per client")
    ap.add_argument("--concurrency", type=int, default=None, help="--clients: requests in flight")
    args = ap.parse_args(argv)
    if args.clients:
        fill_defaults(args, CLIENTS)
        return run_clients(args)
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    rates = sorted(args.rates)
    if not all(0 < r < math.inf for r in rates):
        raise SystemExit(f"--rates {rates}: expected finite rates > 0")

    counts = [max(args.min_prompts, round(r * args.duration)) for r in rates]
    t0 = time.perf_counter()
    prompts = corpus_prompts(WARMUP_PROMPTS + sum(counts), args.input_len, seed=args.seed)
    warm, prompt_sets, at = prompts[:WARMUP_PROMPTS], [], WARMUP_PROMPTS
    for n in counts:
        prompt_sets.append(prompts[at:at + n])
        at += n
    print(f"model {model_name(args.model) if args.model else 'COURSE_MODEL'}; {sum(counts)} requests of "
          f"{args.input_len} prompt tokens and {args.output_len} output tokens over rates {rates} req/s; "
          f"SLO p99 TTFT <= {args.slo_ttft_ms:g} ms")

    commands = server_commands(args.model, args.max_num_seqs)
    with ExitStack() as stack:
        urls = {}
        for name, cmd in commands.items():
            port = free_port()
            t = time.perf_counter()
            urls[name] = stack.enter_context(start_server(cmd(port), port, timeout_s=180))
            warmup = load(urls[name], SERVED_NAME, warm, max_tokens=args.output_len, timeout_s=args.timeout)
            if warmup["failed"]:
                raise SystemExit(f"{name} failed its warm-up: {warmup['errors']}")
            print(f"{name}: up and warm in {time.perf_counter() - t:.1f} s ({' '.join(cmd(port)[1:])})")
        rows = sweep(urls, prompt_sets, rates, args)

    best = {name: sustained(r) for name, r in rows.items()}
    peak = {name: max(r["output_throughput"] for r in rs) for name, rs in rows.items()}
    ratio = best["ours"] / best["peer"] if best["peer"] else None
    print(f"\nhighest rate meeting p99 TTFT <= {args.slo_ttft_ms:g} ms with no failures: ours {best['ours']:g} req/s, "
          f"peer {best['peer']:g} req/s")
    if ratio is None:
        print("the peer meets the SLO at no swept rate: sweep lower rates (--rates) for a ratio")
    else:
        bound = " (a lower bound: ours met the SLO at the highest rate swept)" if best["ours"] == rates[-1] else ""
        print(f"ratio ours / peer: {ratio:.2f}x{bound}  target >= {TARGET:g}x: {'PASS' if ratio >= TARGET else 'FAIL'}")
    print(f"peak output tokens/s: ours {peak['ours']:.0f}, peer {peak['peer']:.0f} "
          f"({peak['ours'] / peak['peer']:.2f}x)")
    print(f"wall time {time.perf_counter() - t0:.0f} s")

    from nanoserve import __version__
    record = dict(benchmark="serving", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  nanoserve=__version__, machine=machine_info(),
                  model=model_name(args.model) if args.model else "COURSE_MODEL", quick=args.quick,
                  workload=dict(rates=rates, requests_per_rate=counts, input_len=args.input_len,
                                output_len=args.output_len, burstiness=args.burstiness, seed=args.seed,
                                warmup_requests=WARMUP_PROMPTS),
                  servers={name: " ".join(cmd(0)[1:]).replace("--port 0", "--port PORT")
                           for name, cmd in commands.items()},
                  slo=dict(p99_ttft_ms=args.slo_ttft_ms, failures=0), sustained_rate=best,
                  ratio=None if ratio is None else round(ratio, 3), target=TARGET, peak_output_throughput=peak,
                  curves=rows)
    save_record(record, args.save, "serving-quick" if args.quick else "serving")
    return record


if __name__ == "__main__":
    main()
