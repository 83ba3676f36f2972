"""The load client (chapter 09): what `vllm bench serve` measures, with its definitions, against any server
that speaks OpenAI's streaming completions.

    summary = load("http://127.0.0.1:8000", "course", prompts, max_tokens=64, request_rate=4.0)
    summary["p99_ttft_ms"], summary["output_throughput"], summary["requests"][0]["itl"]

Each request streams `POST /v1/completions` (temperature 0, ignore_eos, include_usage) and is timed from the
moment it is sent, on the client, as vLLM's benchmark times it:

    TTFT    time to first token: until the first chunk whose text is not empty
    ITL     inter-token latency: the gaps between successive chunks with text (a chunk may hold several tokens)
    E2EL    end-to-end latency: until the last chunk with text
    TPOT    time per output token after the first: (E2EL - TTFT) / (completion_tokens - 1), with the token
            count from the usage chunk (only for requests of more than one token)

Throughputs divide by the whole run's wall time (`duration`): completed requests, output tokens, and prompt +
output tokens per second. Goodput counts, per second, the requests that met every given SLO (ttft, tpot, e2el,
in ms). Percentiles are numpy's (linear interpolation) over completed requests; ITL over all their gaps.
A request fails on a non-200 answer (its status and the server's error message are kept), an error in the
stream, a stream that ends before `data: [DONE]` or without one token, or a timeout; failures count in
`failed` and never in the latencies.

Arrivals follow vLLM: inter-arrival times drawn from a gamma distribution with shape = burstiness and
scale = 1 / (rate * burstiness), seeded: burstiness 1 is a Poisson process, below 1 burstier, above 1 more
regular; the mean is 1 / rate either way. `request_rate=inf` sends everything at once. `max_concurrency` caps
the requests in flight (a semaphore): a request waiting for it is not yet sent, and its clock has not started.

`start_server` runs a server in a subprocess on a free loopback port for as long as a `with` block lasts
(the benchmark, the tests and chapter 09 use it for both our server and the naive peer).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from nanoserve.ports import free_port as free_port  # re-exported: chapter 09 takes it from here

SLO_METRICS = ("ttft", "tpot", "e2el")    # the latencies an SLO may bound, in ms (vLLM's --goodput keys)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_KEPT = 5


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `sent` from the start of the run."""
    prompt: str
    max_tokens: int
    sent: float = 0.0
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (tokens - 1): the mean time per token after the first; None for one token."""
        n = self.completion_tokens
        return (self.e2el - self.ttft) / (n - 1) if self.ok and n > 1 else None


# --- arrivals ----------------------------------------------------------------------------------------------

def arrival_intervals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds between successive requests (n of them; the first request goes at once, after 0 s):
    gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate; all zeros for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"request_rate = {request_rate!r}: expected > 0 (float('inf') sends all at once)")
    if not burstiness > 0:
        raise ValueError(f"burstiness = {burstiness!r}: expected > 0 (1.0 is a Poisson process)")
    if math.isinf(request_rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def send_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """When each request is due, in seconds from the start: 0, then the running sum of the intervals."""
    gaps = arrival_intervals(n, request_rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else gaps



def one_at_a_time_waits(due, service_s: float) -> np.ndarray:
    """How long each arrival waits in line at a server that serves one request at a time, first come first
    served, each taking service_s: the queueing model of a server without batching."""
    if service_s <= 0:
        raise ValueError(f"service_s = {service_s!r}: expected the time one request takes alone, > 0")
    waits, free_at = [], 0.0
    for at in due:
        start = max(float(at), free_at)
        waits.append(start - float(at))
        free_at = start + service_s
    return np.array(waits)

# --- one request -------------------------------------------------------------------------------------------

def error_message(status: int, body: bytes) -> str:
    """'HTTP 429: <the server's message>' from an OpenAI-style error body (or the raw body)."""
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode(errors="replace")[:300]
    return f"HTTP {status}: {msg}"


async def sse_events(response: httpx.Response):
    """The data of each server-sent event: `data:` lines, an event ending at a blank line."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, rec: RequestRecord, t0: float):
    """Streams one completion into `rec`; any failure is recorded on it, never raised."""
    rec.sent = time.perf_counter() - t0
    start = last = time.perf_counter()
    texts, done = [], False
    try:
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                rec.error = error_message(r.status_code, await r.aread())
                return
            async for data in sse_events(r):
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"error in stream: {chunk['error'].get('message', chunk['error'])}"
                    return
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.completion_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                text = (choices[0].get("text") or "") if choices else ""
                if text:   # an empty chunk is no token arriving: it moves neither TTFT nor ITL
                    now = time.perf_counter()
                    if not texts:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    texts.append(text)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return
    rec.text = "".join(texts)
    if not done:
        rec.error = "the stream ended before data: [DONE]"
    elif not texts:
        rec.error = "no token arrived (every chunk's text was empty)"
    elif not rec.completion_tokens:
        rec.error = "no usage chunk with completion_tokens (send stream_options.include_usage)"
    else:
        rec.e2el, rec.ok = last - start, True


# --- a run -------------------------------------------------------------------------------------------------

async def run_load(base_url: str, model: str, prompts: list[str], *, max_tokens: int | list[int],
                   request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int | None = None,
                   seed: int = 0, slo: dict | None = None, api_key: str | None = None,
                   timeout_s: float = 120.0, send_at: list[float] | None = None) -> dict:
    """Sends every prompt once, on the arrival schedule, and returns `summarize`'s dict (with "requests").

    max_tokens: one for all, or one per prompt. slo: e.g. {"ttft": 500, "tpot": 50} in ms, for goodput.
    timeout_s bounds each request from the moment it is sent (connecting, every read, and the whole stream).
    send_at: each request's send time in seconds from the start (a trace's arrivals), instead of drawing them.
    """
    sizes = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(sizes) != len(prompts):
        raise ValueError(f"max_tokens has {len(sizes)} entries for {len(prompts)} prompts: expected one per prompt")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency = {max_concurrency!r}: expected >= 1 or None (no cap)")
    check_slo(slo)
    if send_at is not None and len(send_at) != len(prompts):
        raise ValueError(f"send_at has {len(send_at)} times for {len(prompts)} prompts: expected one per prompt")
    due = send_times(len(prompts), request_rate, burstiness, seed) if send_at is None else np.asarray(send_at)
    records = [RequestRecord(p, n) for p, n in zip(prompts, sizes)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = base_url.rstrip("/") + "/v1/completions"

    async def one(rec: RequestRecord):
        payload = {"model": model, "prompt": rec.prompt, "max_tokens": rec.max_tokens, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        if limit:
            await limit.acquire()
        try:
            async with asyncio.timeout(timeout_s):
                await send_request(client, url, payload, rec, t0)
        except TimeoutError:
            rec.ok, rec.error = False, f"timed out after {timeout_s} s"
        finally:
            if limit:
                limit.release()

    pool = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                                 limits=pool) as client:
        t0 = time.perf_counter()
        tasks = []
        for rec, at in zip(records, due):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))   # to the schedule: no drift
            tasks.append(asyncio.create_task(one(rec)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    out = summarize(records, duration, slo)
    # JSON has no infinity: an unlimited rate is recorded as "inf", as vLLM records it
    out.update(request_rate="inf" if math.isinf(request_rate) else request_rate, burstiness=burstiness,
               max_concurrency=max_concurrency)
    return out


def load(base_url: str, model: str, prompts: list[str], **kwargs) -> dict:
    """`run_load` from synchronous code (a script, a test). A notebook's cells run inside an event loop, where
    this cannot start one: there, `await run_load(...)`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load(base_url, model, prompts, **kwargs))
    raise RuntimeError("load() was called inside a running event loop (a notebook cell, an async function): "
                       "use `await run_load(...)` there")


# --- metrics -----------------------------------------------------------------------------------------------

def check_slo(slo: dict | None) -> None:
    for key, ms in (slo or {}).items():
        if key not in SLO_METRICS:
            raise ValueError(f"SLO on {key!r}: expected one of {', '.join(SLO_METRICS)} (in ms)")
        if not (isinstance(ms, (int, float)) and ms > 0):
            raise ValueError(f"SLO {key} = {ms!r}: expected a number of ms > 0")


def meets(rec: RequestRecord, slo: dict) -> bool:
    """Whether a completed request met every SLO (a one-token request's TPOT counts as 0, as in vLLM)."""
    ms = {"ttft": rec.ttft * 1e3, "tpot": (rec.tpot or 0.0) * 1e3, "e2el": rec.e2el * 1e3}
    return all(ms[k] <= limit for k, limit in slo.items())


def summarize(records: list[RequestRecord], duration: float, slo: dict | None = None) -> dict:
    """vLLM's summary of a run (its key names): counts, throughputs, goodput, and per latency its mean, std,
    median, p90 and p99 in ms; then the first few errors and every request's record."""
    ok = [r for r in records if r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.completion_tokens for r in ok)
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    out = dict(completed=len(ok), failed=len(records) - len(ok), duration=duration,
               total_input_tokens=total_in, total_output_tokens=total_out,
               request_throughput=len(ok) / duration, output_throughput=total_out / duration,
               total_token_throughput=(total_in + total_out) / duration,
               request_goodput=sum(meets(r, slo) for r in ok) / duration if slo else None, slo=slo or None)
    for name in LATENCIES:
        ms = np.asarray(values[name], dtype=float) * 1e3
        stat = (lambda f: float(f(ms))) if ms.size else (lambda f: 0.0)   # vLLM reports 0 when there is none
        out[f"mean_{name}_ms"] = stat(np.mean)
        out[f"std_{name}_ms"] = stat(np.std)
        out[f"median_{name}_ms"] = stat(np.median)
        for p in (90, 99):
            out[f"p{p}_{name}_ms"] = stat(lambda a: np.percentile(a, p))
    errors = [r.error for r in records if not r.ok]
    out["errors"] = errors[:MAX_ERRORS_KEPT]
    out["requests"] = [asdict(r) | {"tpot": r.tpot} for r in records]
    return out


def format_summary(s: dict) -> str:
    """The summary as vLLM's benchmark prints it."""
    rows = [("Traffic request rate", f"{s['request_rate']:g}" if s["request_rate"] != "inf" else "inf"), ("Burstiness factor", f"{s['burstiness']:g}"),
            ("Maximum request concurrency", s["max_concurrency"]),
            ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}")]
    if s.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{s['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k + ':':<40}{v!s:<10}" for k, v in rows]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in LATENCIES:
        lines.append("{s:{c}^50}".format(s=titles[name], c="-"))
        for label, key in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99")):
            lines.append(f"{f'{label} {name.upper()} (ms):':<40}{s[f'{key}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


# --- prompts -----------------------------------------------------------------------------------------------

def corpus_prompts(n: int, input_len: int, seed: int = 0, model: str | None = None) -> list[str]:
    """n prompts of about `input_len` tokens each: disjoint windows of the course corpus (the standard library's
    .py files, read in a seeded order), cut with the model's tokenizer. Nothing is downloaded.

    Disjoint, so no prompt shares a prefix with another (a prefix cache gains nothing a real workload would
    not give it). The server re-tokenizes the text, so its count may differ from input_len by a token or two.
    """
    from nanoserve import COURSE_MODEL, tokenizer
    from nanoserve.course.corpus import corpus_files, read
    if n < 0 or input_len < 1:
        raise ValueError(f"n = {n}, input_len = {input_len}: expected n >= 0 and input_len >= 1")
    tok = tokenizer.load(model or COURSE_MODEL)
    train, val = corpus_files()
    files = train + val
    random.Random(seed).shuffle(files)
    ids: list[int] = []
    for f in files:
        if len(ids) >= n * input_len:
            break
        ids += tok.encode(read(f), add_special_tokens=False)
    if len(ids) < n * input_len:
        raise ValueError(f"the corpus holds {len(ids)} tokens: too few for {n} prompts of {input_len}")
    return [tok.decode(ids[i * input_len:(i + 1) * input_len]) for i in range(n)]


def file_prompts(path: str | Path, n: int | None = None) -> tuple[list[str], list[int | None]]:
    """Prompts from a JSON-lines file, one {"prompt": str, "max_tokens": int (optional)} per line (a trace file's
    {"spec": ...} header line is skipped)."""
    prompts, sizes = [], []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if isinstance(row, dict) and set(row) == {"spec"}:   # a trace file's header (nanoserve.serve.workload)
                continue
            prompts.append(row["prompt"] if isinstance(row, dict) else row)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}:{i}: expected a JSON object with a \"prompt\" ({type(e).__name__}: {e})")
        sizes.append(row.get("max_tokens") if isinstance(row, dict) else None)
    if n is not None:
        prompts, sizes = prompts[:n], sizes[:n]
    return prompts, sizes


# --- servers in subprocesses -------------------------------------------------------------------------------

def wait_healthy(base_url: str, proc: subprocess.Popen, log, timeout_s: float) -> None:
    """Polls GET /health until 200; raises if the process exits first or timeout_s passes (with its log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before {base_url}/health answered:\n"
                               f"{log_tail(log)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout_s} s:\n{log_tail(log)}")
        time.sleep(0.2)


def log_tail(log, chars: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-chars:]


@contextmanager
def start_server(cmd: list[str], port: int, timeout_s: float = 120.0, host: str = "127.0.0.1", env=None):
    """Runs `cmd` (a server that listens on host:port) for the length of a `with` block; yields its base URL
    once GET /health answers. The process is always stopped on leaving: SIGTERM, then SIGKILL after 10 s.

        port = free_port()
        with start_server([sys.executable, "-m", "nanoserve.serve.naive", "--port", str(port)], port) as url:
            load(url, "course", prompts, max_tokens=32)
    """
    with start_servers([(cmd, port)], timeout_s, host, env) as (url,):
        yield url


class ServerURL(str):
    """A running server's base URL, which also knows its process id (`.pid`: for its memory, say)."""
    pid: int


@contextmanager
def start_servers(servers: list[tuple], timeout_s: float = 120.0, host: str = "127.0.0.1", env=None):
    """Several `start_server`s at once, each (cmd, port) or (cmd, port, its own env): every process starts before
    any is waited for, so they load their models side by side; yields their base URLs in order. Each is stopped
    on leaving, whatever happened."""
    with ExitStack() as stack:
        started, procs = [], []
        stack.callback(stop_processes, procs)          # runs last; the children keep their own log descriptors
        for cmd, port, *own_env in servers:
            log = stack.enter_context(tempfile.TemporaryFile())
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=own_env[0] if own_env else env)
            procs.append(proc)
            url = ServerURL(f"http://{host}:{port}")
            url.pid = proc.pid
            started.append((url, proc, log))
        deadline = time.monotonic() + timeout_s
        for url, proc, log in started:
            wait_healthy(url, proc, log, max(1.0, deadline - time.monotonic()))
        yield [url for url, _, _ in started]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to all (they drain side by side), then SIGKILL to any still running 10 s later."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id GET /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
    return models[0]["id"]


# --- command line ------------------------------------------------------------------------------------------

def parse_goodput(items: list[str] | None) -> dict | None:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (ms), as vLLM's --goodput."""
    if not items:
        return None
    slo = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MS, e.g. ttft:500") from None
    check_slo(slo)
    return slo


def main(argv=None) -> dict:
    """`python -m nanoserve bench-serve`: load a running server, print vLLM's table, optionally save the record."""
    from datetime import datetime, timezone

    from nanoserve import __version__
    from nanoserve.course.bench import machine_info, save_record
    ap = argparse.ArgumentParser(prog="nanoserve bench-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="the served model name (default: the first of GET /v1/models)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens, cut from the course corpus")
    ap.add_argument("--output-len", type=int, default=64, help="tokens per request (ignore_eos)")
    ap.add_argument("--prompts-file", default=None, help='JSON lines {"prompt": ..., "max_tokens": ...} instead')
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--save-result", action="store_true")
    ap.add_argument("--save-detailed", action="store_true", help="keep every request's record in the JSON")
    ap.add_argument("--result-dir", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    try:
        slo = parse_goodput(args.goodput)
        if args.prompts_file:
            prompts, sizes = file_prompts(args.prompts_file, args.num_prompts)
            max_tokens = [n or args.output_len for n in sizes]
        else:
            prompts, max_tokens = corpus_prompts(args.num_prompts, args.input_len, args.seed), args.output_len
        model = args.model or served_model(args.base_url, args.api_key)
        summary = load(args.base_url, model, prompts, max_tokens=max_tokens, request_rate=args.request_rate,
                       burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, slo=slo,
                       api_key=args.api_key, timeout_s=args.timeout)
    except (ValueError, OSError, httpx.HTTPError) as e:
        raise SystemExit(f"nanoserve bench-serve: {e}")
    print(format_summary(summary))
    if args.save_result:
        record = dict(benchmark="serve", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      nanoserve=__version__, machine=machine_info(), base_url=args.base_url, model=model,
                      num_prompts=len(prompts), input_len=None if args.prompts_file else args.input_len,
                      output_len=args.output_len, seed=args.seed)
        record |= {k: v for k, v in summary.items() if k != "requests" or args.save_detailed}
        save_record(record, args.result_dir, "serve")
    return summary


if __name__ == "__main__":
    main()
