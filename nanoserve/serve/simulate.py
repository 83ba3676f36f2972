"""A model of a serving engine (chapter 11): the scheduler's policy, replayed step by step, with step costs that
were measured through the server. It predicts each request's TTFT and TPOT for a trace at a rate, so a
configuration can be judged against an SLO before it runs.

    cost = StepCost(batches=(1, 4, 32), decode_s=(0.0027, 0.0057, 0.0127), prefill_s_per_token=1.0e-4)
    config = Config(max_num_seqs=32, max_num_batched_tokens=2048, enable_prefix_caching=True)
    run = simulate(prompt_ids, max_tokens, send_times, cost, config)      # per request: ttft_s, tpot_s
    summary(run)["p90_ttft_ms"]

What it models, as `nanoserve.engine.scheduler` does it: each step carries every running sequence's next token
(a decode, or the next chunk of its prompt) within the token budget, then admits waiting requests first come
first served while there is room under max_num_seqs and tokens left; a prompt longer than what is left is
prefilled in chunks. With prefix caching, a prompt skips its leading full blocks that an earlier prompt has
already computed (the shared system prompt). A step costs the decode time of its batch (interpolated between
the measured batch sizes) plus the prefill time of its prompt tokens; a request reaches the engine its HTTP
cost after it was sent (the event loop works beside the engine). What it leaves out: the KV pool running
short (preemption), the HTTP side's own queueing, and the noise of a shared machine; a measurement says how much
these matter.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    batches: tuple[int, ...]          # decode batch sizes measured, ascending
    decode_s: tuple[float, ...]       # a step's seconds at each (through the server: streaming included)
    prefill_s_per_token: float        # a prompt token's seconds in a step
    request_s: float = 0.0            # a request's way in (HTTP, JSON, tokenizing) before the engine sees it

    def step_s(self, decodes: int, prefill_tokens: int) -> float:
        return float(np.interp(max(decodes, 1), self.batches, self.decode_s)) + prefill_tokens * self.prefill_s_per_token


@dataclass(frozen=True)
class Config:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    block_size: int = 16


def simulate(prompt_ids: list[list[int]], max_tokens: list[int], send_times: list[float], cost: StepCost,
             config: Config, steps: list | None = None) -> list[dict]:
    """Each request's predicted times in seconds: ttft_s, tpot_s (None for a one-token request), e2el_s,
    and the prompt tokens the prefix cache held. `steps`, if given, receives one record per step."""
    n = len(prompt_ids)
    # the event loop does a request's HTTP work on its own thread, beside the engine: it delays the request's
    # arrival at the engine, it does not take the engine's time
    arrive = [t + cost.request_s for t in send_times]
    bs = config.block_size
    cached: set[tuple[int, ...]] = set()         # full-block prefixes computed so far
    todo = [len(p) for p in prompt_ids]          # prompt tokens still to compute
    hits = [0] * n
    made = [0] * n                                # tokens generated
    first, last = [None] * n, [None] * n
    waiting, running, arrived = [], [], 0
    now = 0.0
    while arrived < n or waiting or running:
        while arrived < n and arrive[arrived] <= now:
            waiting.append(arrived)
            arrived += 1
        if not waiting and not running:
            now = arrive[arrived]
            continue
        budget, decodes, prefill, chunks = config.max_num_batched_tokens, 0, 0, {}
        for r in running:                         # decodes and unfinished prompts first
            if budget <= 0:
                break
            take = 1 if todo[r] == 0 else min(todo[r], budget)
            decodes += take == 1 and todo[r] == 0
            prefill += 0 if todo[r] == 0 else take
            chunks[r] = take
            budget -= take
        while waiting and len(running) < config.max_num_seqs and budget > 0:
            r = waiting.pop(0)
            if config.enable_prefix_caching:
                ids = prompt_ids[r]
                k = 0
                while (k + 1) * bs < len(ids) and tuple(ids[:(k + 1) * bs]) in cached:
                    k += 1
                hits[r], todo[r] = k * bs, len(ids) - k * bs
            take = min(todo[r], budget)
            running.append(r)
            chunks[r] = take
            prefill += take
            budget -= take
        seconds = cost.step_s(decodes, prefill)
        now += seconds
        if steps is not None:
            steps.append(dict(tokens=decodes + prefill, decodes=decodes, prefill=prefill, seqs=len(running),
                              seconds=seconds))
        for r, take in chunks.items():
            if todo[r] > 0:
                todo[r] -= take
                if todo[r] == 0 and config.enable_prefix_caching:
                    ids = prompt_ids[r]
                    cached.update(tuple(ids[:j * bs]) for j in range(1, len(ids) // bs + 1))
                if todo[r] > 0:
                    continue                      # a chunk: no token yet
            made[r] += 1                          # the prompt's last chunk samples the first token
            if made[r] == 1:
                first[r] = now
            if made[r] >= max_tokens[r]:
                last[r] = now
        running = [r for r in running if last[r] is None]
    out = []
    for r in range(n):
        tpot = (last[r] - first[r]) / (max_tokens[r] - 1) if max_tokens[r] > 1 else None
        out.append(dict(ttft_s=first[r] - send_times[r], tpot_s=tpot, e2el_s=last[r] - send_times[r],
                        cached_tokens=hits[r]))
    return out


def step_log(prompt_ids, max_tokens, send_times, cost: StepCost, config: Config) -> list[dict]:
    """The simulated steps: per step the tokens it carried (decodes + prompt tokens), the running sequences
    and its seconds."""
    steps: list[dict] = []
    simulate(prompt_ids, max_tokens, send_times, cost, config, steps)
    return steps


def summary(run: list[dict]) -> dict:
    """Median, p90 and p99 of TTFT and TPOT in ms (numpy's percentiles, the load client's names)."""
    ttft = np.array([r["ttft_s"] for r in run]) * 1e3
    tpot = np.array([r["tpot_s"] for r in run if r["tpot_s"] is not None]) * 1e3
    return {f"{q}_{name}_ms": float(np.percentile(a, p)) for name, a in (("ttft", ttft), ("tpot", tpot))
            for q, p in (("median", 50), ("p90", 90), ("p99", 99))}
