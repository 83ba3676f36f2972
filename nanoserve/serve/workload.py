"""A service's request trace (chapter 11): a chat-like workload, shipped as JSON lines, replayed at any rate.

    trace = workload.load_trace()                           # benchmarks/traces/chat_service.jsonl
    await run_load(url, "course", trace.prompts, max_tokens=trace.max_tokens, send_at=trace.send_times(rate))

Each request is a shared system prompt (on most requests) followed by a user turn, both windows of the course
corpus, and asks for a drawn number of new tokens. Arrivals are a Poisson process drawn at one request per second
and scaled to the rate asked for, so every rate replays the same requests in the same order. The file is made
by `python -m nanoserve.serve.workload` from a seed; a test checks the shipped file is what that command makes.
Lengths are in the course model's tokens; the server re-tokenizes the text, so a count may move by one or two.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "chat_service.jsonl"


@dataclass(frozen=True)
class TraceSpec:
    """How the shipped trace is drawn: every number a reader needs to reproduce it."""
    num_requests: int = 240
    shared_fraction: float = 0.8         # requests that open with the system prompt
    system_tokens: int = 512
    user_tokens: tuple[int, int] = (16, 64)      # uniform, inclusive
    output_tokens: tuple[int, int] = (16, 48)    # uniform, inclusive (ignore_eos: each request makes exactly this many)
    seed: int = 0


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    arrival_s: float       # at one request per second on average; at rate r it is sent at arrival_s / r
    shared: bool           # opens with the system prompt
    prompt_tokens: int     # system + user, in the course model's tokens


@dataclass(frozen=True)
class Trace:
    requests: list[Request]
    spec: TraceSpec

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> "Trace":
        """The first n requests (their arrivals unchanged)."""
        return Trace(self.requests[:n], self.spec)

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.requests]

    @property
    def max_tokens(self) -> list[int]:
        return [r.max_tokens for r in self.requests]

    def send_times(self, rate: float) -> list[float]:
        """When each request is sent, in seconds from the start, at `rate` requests per second on average."""
        if not rate > 0:
            raise ValueError(f"rate = {rate!r}: expected requests per second > 0")
        return [r.arrival_s / rate for r in self.requests]


def make_trace(spec: TraceSpec = TraceSpec()) -> Trace:
    from nanoserve import COURSE_MODEL, tokenizer
    from nanoserve.serve.load import corpus_prompts
    rng = random.Random(spec.seed)
    tok = tokenizer.load(COURSE_MODEL)
    hi = spec.user_tokens[1]
    # one window for the system prompt, then one per request for its user turn (disjoint: no accidental sharing)
    windows = corpus_prompts(spec.num_requests + 1, max(spec.system_tokens, hi), seed=spec.seed)
    ids = lambda text: tok.encode(text, add_special_tokens=False)
    system = tok.decode(ids(windows[0])[:spec.system_tokens])
    gaps = np.random.default_rng(spec.seed).exponential(1.0, spec.num_requests)
    requests = []
    for k, (window, at) in enumerate(zip(windows[1:], np.cumsum(gaps) - gaps[0])):
        user = tok.decode(ids(window)[:rng.randint(*spec.user_tokens)])
        shared = rng.random() < spec.shared_fraction
        prompt = system + user if shared else user
        requests.append(Request(prompt, rng.randint(*spec.output_tokens), round(float(at), 6), shared,
                                len(ids(prompt))))
    return Trace(requests, spec)


def save_trace(trace: Trace, path: str | Path) -> None:
    lines = [json.dumps({"spec": asdict(trace.spec)})] + [json.dumps(asdict(r)) for r in trace.requests]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def load_trace(path: str | Path = SHIPPED) -> Trace:
    """A trace file: its spec on the first line, then one request per line (the load client's `file_prompts`
    reads the same file: each line has a "prompt" and a "max_tokens")."""
    lines = Path(path).read_text().splitlines()
    try:
        spec = json.loads(lines[0])["spec"]
        spec = TraceSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
        requests = [Request(**json.loads(line)) for line in lines[1:] if line.strip()]
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a trace file (a spec line, then one request per line): "
                         f"{type(e).__name__}: {e}") from None
    return Trace(requests, spec)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanoserve.serve.workload", description="write the shipped trace")
    ap.add_argument("--out", default=str(SHIPPED))
    args = ap.parse_args(argv)
    trace = make_trace()
    save_trace(trace, args.out)
    print(f"{len(trace)} requests -> {args.out}")


if __name__ == "__main__":
    main()
