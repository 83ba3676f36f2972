"""The capstone's service (chapter 11 and lab 11): its configurations, its servers, its ceilings and its SLO.

    with capstone.servers({"deployed": capstone.DEPLOYED, "wide": ["--max-num-seqs", "32"]}) as urls:
        ceilings = await capstone.measure_ceilings(urls["deployed"], urls["wide"], trace)
        ceilings.cost, ceilings.slo        # the model's step costs, and the SLO derived from them

Ceilings are measured through the server (HTTP and streaming included), as the best of a few tries:

- the longest prompt's TTFT alone, and a one-token prompt's, on a server without a prefix cache (every prompt is
  computed): the prefill a request can need, and a request's way in (HTTP, JSON, tokenizing) plus one step;
- a decode step at batch B: B trace requests sent at once to a server with room for them, the median gap between
  two streamed tokens (most gaps are decode steps of the whole batch).

The SLO: p90 TTFT within four times the longest prompt's TTFT alone, p90 TPOT within a quarter above a decode step of
32 requests (`slo.PERCENTILE` says why p90).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from nanoserve.serve import simulate
from nanoserve.serve.load import free_port, run_load, start_servers

# the service as deployed: settings copied from a latency test
DEPLOYED = ["--max-num-seqs", "4", "--no-enable-prefix-caching"]
SERVE = [sys.executable, "-m", "nanoserve", "serve", "--device", "cpu", "--dtype", "float32"]
BATCHES = (1, 4, 16, 32)


@contextmanager
def servers(configs: dict[str, list[str]], profile_dir: str | None = None, peer: bool = False):
    """Start one `nanoserve serve` per configuration (its flags), side by side, and with `peer` the naive server of
    chapter 09; yields {name: base URL}. With `profile_dir`, each can be profiled (/start_profile)."""
    names = list(configs)
    commands = [(SERVE + ["--port", str(port := free_port())] + flags
                 + (["--profile-dir", profile_dir] if profile_dir else []), port) for flags in configs.values()]
    if peer:   # as in chapter 09: one request at a time gains nothing from a thread team
        names.append("peer")
        commands.append(([sys.executable, "-m", "nanoserve.serve.naive", "--port", str(port := free_port())], port,
                         dict(os.environ, OMP_NUM_THREADS="1")))
    with start_servers(commands) as urls:
        for url in urls:        # a server's first requests pay one-off costs
            _warm(url)
        yield dict(zip(names, urls))


def _warm(url: str) -> None:
    import httpx
    for prompt in ("def f(x):", "import os\n"):
        httpx.post(f"{url}/v1/completions", json={"model": "course", "prompt": prompt, "max_tokens": 4},
                   timeout=60).raise_for_status()


def config_of(flags: list[str]) -> simulate.Config:
    """The model's view of a server's flags (max_num_seqs, max_num_batched_tokens, prefix caching), with the
    engine's defaults for those not given."""
    from nanoserve.engine.args import EngineArgs
    import argparse
    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    args = EngineArgs.from_cli_args(ap.parse_args(flags))
    return simulate.Config(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size)


@dataclass(frozen=True)
class Ceilings:
    ttft_longest_s: float
    longest_tokens: int
    ttft_tiny_s: float
    step_s: dict                  # batch -> seconds per decode step
    cost: simulate.StepCost
    slo: dict                     # {"ttft": ms, "tpot": ms}

    def describe(self) -> str:
        return "\n".join([
            f"longest prompt ({self.longest_tokens} tokens) TTFT alone {self.ttft_longest_s * 1e3:.1f} ms; "
            f"a one-token prompt's {self.ttft_tiny_s * 1e3:.1f} ms",
            "decode step: " + ", ".join(f"batch {b} {s * 1e3:.1f} ms" for b, s in self.step_s.items()),
            f"so: {self.cost.prefill_s_per_token * 1e6:.0f} us per prompt token, {self.cost.request_s * 1e3:.1f} ms "
            f"for a request's way in",
            f"SLO: p90 TTFT <= {self.slo['ttft']:.0f} ms, p90 TPOT <= {self.slo['tpot']:.1f} ms"])


async def measure_ceilings(uncached_url: str, wide_url: str, trace, tokenizer, tries: int = 3) -> Ceilings:
    """The ceilings and the SLO (the module's docstring). uncached_url: a server without a prefix cache; wide_url:
    one with room for 32 sequences."""
    longest = max(trace.requests, key=lambda r: r.prompt_tokens)
    longest_tokens = len(tokenizer.encode(longest.prompt, add_special_tokens=False))

    async def best_ttft(prompts) -> float:     # a ceiling is the best the machine does: the fastest of a few
        return min([(await run_load(uncached_url, "course", [p], max_tokens=2))["median_ttft_ms"]
                    for p in prompts]) / 1e3

    ttft_longest = await best_ttft([longest.prompt] * tries)
    ttft_tiny = await best_ttft([f"#{i}" for i in range(tries)])
    step_s = {}
    for b in BATCHES:   # trace-like prompts that share no block with the trace's (a prefix cache keeps nothing of them)
        burst = [f"# burst {b}.{i}\n" + r.prompt for i, r in enumerate(trace.requests[:b])]
        step_s[b] = (await run_load(wide_url, "course", burst, max_tokens=48))["median_itl_ms"] / 1e3
    cost = simulate.StepCost(batches=BATCHES, decode_s=tuple(step_s[b] for b in BATCHES),
                             prefill_s_per_token=(ttft_longest - ttft_tiny) / longest_tokens,
                             request_s=max(0.0, ttft_tiny - step_s[1]))
    slo = {"ttft": 4 * ttft_longest * 1e3, "tpot": 1.25 * step_s[32] * 1e3}
    return Ceilings(ttft_longest, longest_tokens, ttft_tiny, step_s, cost, slo)
