"""Third-party load clients against our server: guidellm and aiperf, beside our own `load` (tooling; the runtime
never imports this).

    rows = compare("http://127.0.0.1:8000", Load(requests=16, concurrency=4, input_tokens=64, output_tokens=16))
    rows["rows"]["aiperf"]["mean_ttft_ms"], rows["ratios"]["guidellm"]["output_throughput"], rows["agree"]

Each tool runs as a subprocess of this venv (`<venv>/bin/guidellm`, `<venv>/bin/aiperf`) with a bounded request
count, a fixed concurrency (the mode all three share: a new request goes as soon as one ends), synthetic prompts of
`input_tokens` cut with the model's local tokenizer, and exactly `output_tokens` out (ignore_eos, and min_tokens in
each tool's extra body), over streaming /v1/completions at temperature 0. Each has a hard timeout: its process group
is killed and the error names the tool and ends with its log. Nothing reaches the network: the tools run offline
(HF_HUB_OFFLINE and friends, telemetry off, GPU and server-metrics probes off), with HOME, caches and every artefact
in a temporary directory (as root or not). Each tool's own output files are read into one row:

    completed, failed, mean/median/p99 TTFT (ms), mean ITL (ms), output tokens/s, requests/s,
    mean prompt tokens, the distinct output lengths seen

aiperf and a local tokenizer: with HF_HUB_OFFLINE set, aiperf 0.13 looks every tokenizer name up in the Hugging
Face cache (`snapshot_download(local_files_only=True)`), so a directory path fails as "Repo id must be in the form
'repo_name'". We give it the form it accepts instead: the tokenizer's files in a cache of our own (HF_HUB_CACHE in
the temporary directory, `models--local--<name>/snapshots/<commit>`) and the id `local/<name>`. Offline stays on.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TOOLS = ("guidellm", "aiperf")
METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "output_throughput", "request_throughput")

# Agreement: each tool's number over ours, for the same load against the same server. Why they differ at all:
#   TTFT   ours and aiperf stop the clock at the first chunk with text (vLLM's definition), guidellm at the first
#          SSE line that carries a token (the same chunk here); ours and aiperf start it just before the request
#          goes (httpx, aiohttp), guidellm at the first header write. Each tool also runs its own processes (workers,
#          record processors) on the server's CPU: on 2 cores that competes with the engine (guidellm took 7-13% of
#          a core during its run, aiperf about 10% once its spin is paced, see aiperf_args), and so does any other
#          work on the machine; TTFT, the shortest of the three, moves most. With equal lengths, all three clients
#          settle into waves (the requests of a wave finish together and the next ones start together), so a TTFT
#          holds the prefill of the whole wave, in each.
#   ITL    ours pools the gaps between content chunks over all requests (vLLM's `bench serve`); guidellm takes
#          (last token - first token) / (tokens - 1) per request, weighted by tokens - 1; aiperf takes
#          (request latency - TTFT) / (tokens - 1) per request, unweighted, its latency ending at the stream's
#          last message (the usage chunk). One token per chunk here, equal lengths: the same quantity, so tighter.
#   tput   completed work over a window: ours from the first send to the last completion; guidellm over its
#          measured window; aiperf from the first request to the last response.
#   warm-up: none of the tools warms up here; `compare` warms the server with a few of our requests first.
# The band is what repeated runs of a second or more held on a 2-core CPU shared with other work (each tool within
# 0.6x-1.7x of ours on all three; ITL and throughput, which should agree tighter, moved as much as TTFT there, so
# they get no tighter band). Runs of half a second swung from 0.4x to 2.8x: keep runs longer than that.
BAND = {"mean_ttft_ms": (0.5, 2.0), "mean_itl_ms": (0.5, 2.0), "output_throughput": (0.5, 2.0)}


@dataclass(frozen=True)
class Load:
    """One load, the same for every client: `requests` in all, `concurrency` in flight, prompts of `input_tokens`,
    exactly `output_tokens` each."""
    requests: int = 16
    concurrency: int = 4
    input_tokens: int = 64
    output_tokens: int = 16


class ClientError(RuntimeError):
    """A third-party client failed (missing, timed out, exited non-zero, or wrote no results)."""


class ClientTimeout(ClientError, TimeoutError):
    """A third-party client ran past its time and was killed, with everything it started."""


def executable(tool: str) -> Path:
    """The tool's CLI in this interpreter's venv."""
    path = Path(sys.executable).parent / tool
    if not path.exists():
        raise ClientError(f"{tool} is not installed beside {sys.executable} ({path} is missing): `make setup` "
                          f"installs requirements-clients.txt")
    return path


def offline_env(workdir: Path) -> dict[str, str]:
    """This process's environment with the network, telemetry and every cache turned to `workdir` (made a HOME)."""
    (workdir / "home").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(HOME=str(workdir / "home"), XDG_CACHE_HOME=str(workdir / "cache"), HF_HOME=str(workdir / "hf"),
               HF_HUB_CACHE=str(workdir / "hub"), MPLCONFIGDIR=str(workdir / "mpl"), TMPDIR=str(workdir),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               DO_NOT_TRACK="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               TOKENIZERS_PARALLELISM="false",
               GUIDELLM__MAX_WORKER_PROCESSES="1",        # one worker process: the CPU is the server's
               AIPERF_DATASET_MMAP_CACHE_ENABLED="false")  # else it caches the dataset under ~/.cache
    return env


def run_bounded(name: str, cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None,
                cwd: Path | None = None) -> float:
    """Run `cmd` (a client called `name` in errors) in a process group of its own, its output in `log_path`; wait
    at most timeout_s. The whole group is killed at the end, so no worker outlives it. Returns its seconds; raises
    ClientTimeout or ClientError with the tail of its log."""
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_group(proc)
    if code is None:
        raise ClientTimeout(f"{name} did not finish within {timeout_s:g} s and was killed; its log ends:\n"
                            f"{tail(log_path)}")
    if code != 0:
        raise ClientError(f"{name} exited with code {code}; its log ends:\n{tail(log_path)}")
    return time.perf_counter() - start


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass                                      # the group is gone already
    proc.wait()


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


# --- the commands ------------------------------------------------------------------------------------------

def guidellm_args(base_url: str, model: str, tokenizer_dir: Path, load: Load, out: Path, timeout_s: float) -> list[str]:
    """`guidellm run`: each option a JSON object (guidellm 0.8 reads `kind=...` strings or JSON)."""
    option = lambda **kw: json.dumps(kw, separators=(",", ":"))
    backend = option(kind="openai_http", target=base_url, model=model, request_format="/v1/completions",
                     timeout=timeout_s, extras={"body": {"min_tokens": load.output_tokens, "temperature": 0}})
    return ["run", "--backend", backend,
            "--tokenizer", option(kind="huggingface_auto", model=str(tokenizer_dir)),
            "--data", option(kind="synthetic_text", prompt_tokens=load.input_tokens, output_tokens=load.output_tokens),
            "--profile", option(kind="concurrent", streams=load.concurrency),
            "--constraint", option(kind="max_requests", count=load.requests),
            "--output", option(kind="json", path=str(out / "guidellm.json")),
            "--disable-console-interactive"]


def aiperf_args(base_url: str, model: str, tokenizer_id: str, load: Load, out: Path, timeout_s: float) -> list[str]:
    """`aiperf profile`: output length from the server's usage (--use-server-token-count), not re-tokenized text.

    Concurrency alone makes aiperf's timing manager spin while every slot is taken (it yields to its event loop and
    retries at once: about half a core in `top`, taken from the server on 2 cores); a constant rate far above what
    the server takes turns that into a 1 ms tick, and the concurrency cap still sets the load."""
    extra = {"ignore_eos": True, "min_tokens": load.output_tokens, "temperature": 0}
    return ["profile", "--model", model, "--url", base_url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", tokenizer_id, "--concurrency", str(load.concurrency), "--request-count", str(load.requests),
            "--request-rate", "1000", "--arrival-pattern", "constant",
            "--isl", str(load.input_tokens), "--osl", str(load.output_tokens), "--extra-inputs", json.dumps(extra),
            "--use-server-token-count", "--request-timeout-seconds", f"{timeout_s:g}", "--random-seed", "0",
            "--artifact-dir", str(out / "aiperf"), "--export-level", "records", "--ui", "none",
            "--no-gpu-telemetry", "--no-server-metrics", "--workers-max", "1", "--record-processors", "1"]


def local_hub_entry(tokenizer_dir: Path, hub_cache: Path) -> str:
    """The tokenizer's files (not the weights) laid out as a Hugging Face cache entry; returns its repo id."""
    repo = f"local/{tokenizer_dir.name}"
    entry = hub_cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".tiktoken"):
            shutil.copy(f, snapshot / f.name)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(commit)
    return repo


# --- their results, as one row -----------------------------------------------------------------------------

def guidellm_row(path: Path) -> dict:
    """The row from guidellm's JSON report (its one benchmark)."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m, reqs = bench["metrics"], bench["requests"]
    ttft = m["time_to_first_token_ms"]["successful"]
    ok = reqs["successful"]
    return dict(completed=len(ok), failed=len(reqs["errored"]) + len(reqs["incomplete"]),
                mean_ttft_ms=ttft["mean"], median_ttft_ms=ttft["median"], p99_ttft_ms=ttft["percentiles"]["p99"],
                mean_itl_ms=m["inter_token_latency_ms"]["successful"]["mean"],
                output_throughput=m["output_tokens_per_second"]["successful"]["mean"],
                request_throughput=m["requests_per_second"]["successful"]["mean"],
                mean_prompt_tokens=mean([r["prompt_tokens"] for r in ok]),
                output_lengths=sorted({r["output_tokens"] for r in ok}),
                errors=[str(r.get("error"))[:300] for r in reqs["errored"][:3]])


def aiperf_row(artifacts: Path) -> dict:
    """The row from aiperf's summary JSON, and each request's output length from its records."""
    s = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines() if line]
    ok = [r for r in records if not r.get("error")]
    stat = lambda name, key="avg": (s.get(name) or {}).get(key)
    return dict(completed=int(stat("request_count") or 0), failed=int(stat("error_request_count") or 0),
                mean_ttft_ms=stat("time_to_first_token"), median_ttft_ms=stat("time_to_first_token", "p50"),
                p99_ttft_ms=stat("time_to_first_token", "p99"), mean_itl_ms=stat("inter_token_latency"),
                output_throughput=stat("output_token_throughput"), request_throughput=stat("request_throughput"),
                mean_prompt_tokens=stat("usage_prompt_tokens"),
                output_lengths=sorted({r["metrics"]["output_sequence_length"]["value"] for r in ok}),
                errors=[str(r["error"])[:300] for r in records if r.get("error")][:3])


def ours_row(summary: dict) -> dict:
    """The row from `load`'s summary (vLLM's names already)."""
    ok = [r for r in summary["requests"] if r["ok"]]
    return {k: summary[k] for k in ("completed", "failed", *METRICS)} | dict(
        mean_prompt_tokens=mean([r["prompt_tokens"] for r in ok]),
        output_lengths=sorted({r["completion_tokens"] for r in ok}), errors=summary["errors"][:3])


def mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


# --- running each ------------------------------------------------------------------------------------------

def run_client(tool: str, base_url: str, model: str, load: Load, tokenizer_dir: str | Path,
               timeout_s: float = 120.0) -> tuple[dict, str]:
    """Run guidellm or aiperf once; returns (its row, the command it ran, with the temporary directory as $OUT)."""
    tokenizer_dir = Path(tokenizer_dir).resolve()
    with tempfile.TemporaryDirectory(prefix=f"nanoserve-{tool}-") as tmp:
        out = Path(tmp)
        env = offline_env(out)
        if tool == "guidellm":
            args = guidellm_args(base_url, model, tokenizer_dir, load, out, timeout_s)
        elif tool == "aiperf":
            args = aiperf_args(base_url, model, local_hub_entry(tokenizer_dir, Path(env["HF_HUB_CACHE"])), load,
                               out, timeout_s)
        else:
            raise ValueError(f"tool {tool!r}: expected one of {', '.join(TOOLS)}")
        run_bounded(tool, [str(executable(tool)), *args], out / f"{tool}.log", timeout_s, env=env, cwd=out)
        try:
            row = guidellm_row(out / "guidellm.json") if tool == "guidellm" else aiperf_row(out / "aiperf")
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise ClientError(f"{tool} finished but its results could not be read ({type(e).__name__}: {e}); "
                              f"its log ends:\n{tail(out / f'{tool}.log')}") from None
        command = shlex.join([tool, *args]).replace(tmp, "$OUT")
    return row, command


def run_ours(base_url: str, model: str, load: Load, tokenizer_dir: str | Path, timeout_s: float = 120.0,
             seed: int = 0) -> dict:
    """Our `load` at the same concurrency, on disjoint corpus prompts of the right length."""
    from nanoserve.serve.load import corpus_prompts, load as run_load
    prompts = corpus_prompts(load.requests, load.input_tokens, seed=seed, model=str(tokenizer_dir))
    return ours_row(run_load(base_url, model, prompts, max_tokens=load.output_tokens,
                             max_concurrency=load.concurrency, timeout_s=timeout_s))


def ratios(rows: dict[str, dict]) -> dict[str, dict]:
    """Each tool's numbers over ours (None where either is missing or ours is 0)."""
    ours = rows["ours"]
    return {tool: {k: (row[k] / ours[k] if row.get(k) is not None and ours.get(k) else None) for k in METRICS}
            for tool, row in rows.items() if tool != "ours"}


def agreement(rows: dict[str, dict], load: Load, band: dict = BAND) -> dict[str, bool]:
    """Per tool: every request completed with its asked length, and each banded ratio within its band."""
    out = {}
    for tool, r in ratios(rows).items():
        row = rows[tool]
        complete = row["failed"] == 0 and row["completed"] == load.requests and row["output_lengths"] == [load.output_tokens]
        out[tool] = complete and all(r[k] is not None and lo <= r[k] <= hi for k, (lo, hi) in band.items())
    return out


def compare(base_url: str, load: Load, model: str | None = None, tokenizer_dir: str | Path | None = None,
            timeout_s: float = 120.0, warmup_requests: int = 4) -> dict:
    """Ours, guidellm and aiperf, one after another, under the same load against one server (warmed first with a
    few of our requests, so no client pays the server's first steps): their rows, commands, ratios and agreement."""
    from nanoserve import COURSE_MODEL
    from nanoserve.serve.load import served_model
    model = model or served_model(base_url)
    tokenizer_dir = tokenizer_dir or COURSE_MODEL
    if warmup_requests:
        run_ours(base_url, model, Load(warmup_requests, load.concurrency, load.input_tokens, load.output_tokens),
                 tokenizer_dir, timeout_s, seed=1)
    rows, commands = {"ours": run_ours(base_url, model, load, tokenizer_dir, timeout_s)}, {}
    for tool in TOOLS:
        rows[tool], commands[tool] = run_client(tool, base_url, model, load, tokenizer_dir, timeout_s)
    return dict(load=asdict(load), rows=rows, commands=commands, ratios=ratios(rows),
                band={k: list(v) for k, v in BAND.items()}, agree=agreement(rows, load))


def format_rows(result: dict) -> str:
    """The three rows and the ratios as a small table."""
    lines = [f"{'client':>9} {'done':>5} {'fail':>4} {'TTFT mean':>10} {'p50':>7} {'p99':>7} {'ITL mean':>9} "
             f"{'tok/s':>7} {'req/s':>6}  lengths"]
    for name, r in result["rows"].items():
        lines.append(f"{name:>9} {r['completed']:>5} {r['failed']:>4} {r['mean_ttft_ms']:>8.1f}ms "
                     f"{r['median_ttft_ms']:>5.1f}ms {r['p99_ttft_ms']:>5.1f}ms {r['mean_itl_ms']:>7.2f}ms "
                     f"{r['output_throughput']:>7.1f} {r['request_throughput']:>6.2f}  {r['output_lengths']}")
    for tool, r in result["ratios"].items():
        shown = ", ".join(f"{k} {v:.2f}x" for k, v in r.items() if v is not None)
        lines.append(f"{tool} / ours: {shown}  -> {'agree' if result['agree'][tool] else 'DISAGREE'}")
    return "\n".join(lines)
