"""Speculative decoding on code: decode tokens/s with n-gram (prompt lookup) and draft-model speculation against
the same engine without it, against k and the batch, and the acceptance model that predicts the speed-up.

At batch 1 a decode step costs about the same whether it computes one token or a few: the time is per-step
work (dispatching every layer's ops, reading the weights), not arithmetic. Speculation spends that slack: a
proposer guesses k tokens, the target scores all of them in one forward of k + 1 tokens, and `spec.verify`
keeps the accepted prefix plus one token of the target's own, so greedy output is token for token the target's.
With per-token acceptance alpha the expected tokens per step are E = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan
et al., 2023) and the speed-up is about E / (r + c k): r the verify step (k + 1 tokens) and c one draft step,
both in units of a plain decode step. Batching takes the slack away: B sequences with k + 1 tokens each make
the step compute-bound, r grows with B while E does not, and the speed-up turns below 1x.

The named peer is the same engine on the same model without speculation (vLLM compares its spec decode the
same way): only `speculative_config` differs. Workload: code prompts, windows of `--input-len` tokens of the
course's held-out corpus (standard-library .py files the course models never trained on, identifiers that
repeat), greedy, ignore_eos, `--max-tokens` new tokens, the course model on the CPU in float32. Both course
models were trained on 256-token windows; past that position their greedy text degrades into loops (which
prompt lookup copies, and the draft stops predicting), so prompt + output stay within 256 by default
(128 + 128; the script warns when they do not). Four parts:

  1. batch 1: base, ngram and draft_model interleaved request by request over rounds; decode tokens/s
     (median over rounds), the ratio per method (median of the rounds' paired ratios), acceptance, and a
     check that every output equals the base engine's greedy tokens;
  2. acceptance rate, tokens per step and speed-up against k, both methods, base interleaved with them;
  3. speed-up against the batch (the same prompts, in sets of the batch decoding together) until it turns
     below 1x: the break-even batch, with the verify step's cost at each batch (why it turns);
  4. the model: r, c and the engine's per-step work measured on their own (the target's forward of 1 and of
     k + 1 new tokens a sequence, the draft's forward, the n-gram lookup), the speed-up predicted from alpha
     (Leviathan's E(alpha, k), independent acceptance) and from the measured step mix (tokens per step over
     the cost of the steps as they ran: prompt lookup proposes nothing on some), against the measured one.

Decode tokens/s: the tokens after every request's first, over the time from the last first token (the prefill
done) to the first request's last token (the batch still full), so prefill costs and a closed batch's tail are
out of it (at batch 1: the whole decode). Every engine serves each prompt set once untimed first
(its prefix cache then holds the prompts in every timed round, for every engine alike). The machine may be
shared: engines run one request set after another in a rotated order, a noisy neighbour slows them alike, and
ratios hold better than absolute numbers. The target (>= 1.5x batch-1 tokens/s for the better method on code
prompts) is printed as PASS / FAIL, never asserted. Part 1 also says where prompt lookup's right guesses come from
(the prompt, or the model's own output so far): a small model's greedy text repeats itself, and prompt lookup
gains from that as much as from the prompt.

    python benchmarks/speculative.py                               # ~6 min on 2 cores, 2 threads
    python benchmarks/speculative.py --k-ngram 6 --lookup 2 4      # another n-gram setting
    python benchmarks/speculative.py --batches 1 2 4 8             # a shorter batch sweep
    python benchmarks/speculative.py --quick                       # test-size, under a minute
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

# Run as a script, this folder comes first on sys.path, and benchmarks/kernels.py would shadow the
# `kernels` package that transformers looks for: imports resolve from the repository, not from here.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from nanoserve import COURSE_DRAFT_MODEL, COURSE_MODEL, LLM, SamplingParams, tokenizer  # noqa: E402
from nanoserve.course.bench import fill_defaults, machine_info, save_record  # noqa: E402
from nanoserve.course.corpus import corpus_files, read  # noqa: E402
from nanoserve.engine.model_runner import StepPlan  # noqa: E402
from nanoserve.speculative import NgramProposer  # noqa: E402

TARGET = 1.5   # batch-1 decode tokens/s, the better method over the base engine
METHODS = ("ngram", "draft")
DEFAULTS = dict(input_len=128, max_tokens=128, prompts=12, rounds=5, ks=[1, 2, 4, 6, 8], sweep_prompts=6,
                sweep_rounds=3, batches=[1, 2, 4, 8, 16, 32], batch_prompts=8, batch_rounds=3)
QUICK = dict(input_len=128, max_tokens=48, prompts=3, rounds=2, ks=[2, 4], sweep_prompts=2, sweep_rounds=1,
             batches=[1, 4, 16], batch_prompts=2, batch_rounds=1)


# --- workload ---------------------------------------------------------------------------------------------

def code_prompts(n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """n disjoint windows of `input_len` token ids of held-out Python source: the validation files of
    `nanoserve.course.corpus` (never trained on), in a seeded order, tokenized as one stream, cut evenly
    along it (no two windows share a prefix: the prefix cache gains nothing across prompts)."""
    tok = tokenizer.load(COURSE_MODEL)
    _, val = corpus_files()
    files = list(val)
    random.Random(seed).shuffle(files)
    ids: list[int] = []
    for f in files:
        ids += tok.encode(read(f), add_special_tokens=False)
    stride = len(ids) // max(n, 1)
    if stride < input_len:
        raise ValueError(f"the held-out corpus has {len(ids)} tokens: too few for {n} windows of {input_len}")
    return [ids[i * stride:i * stride + input_len] for i in range(n)]


def spec_config(method: str, k: int, lookup: tuple[int, int]) -> dict | None:
    if method == "base":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
                "prompt_lookup_max": lookup[1]}
    return {"method": "draft_model", "model": COURSE_DRAFT_MODEL, "num_speculative_tokens": k}


def make_llm(method: str, k: int, args, batch: int) -> LLM:
    """An engine for `batch` sequences of the workload: a KV pool just large enough (every engine the same
    size), float32 on args.device."""
    blocks = batch * -(-(args.input_len + args.max_tokens + k + 1) // 16) + 16
    return LLM(device=args.device, dtype="float32", max_num_seqs=max(batch, 2), num_kv_blocks=blocks,
               speculative_config=spec_config(method, k, tuple(args.lookup)))


# --- measuring --------------------------------------------------------------------------------------------

SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def spec_counts(llm: LLM) -> dict:
    m = llm.metrics()
    per_pos = list(m.get("spec_decode_num_accepted_tokens_per_pos", []))
    return {key: m.get(key, 0) for key in SPEC_KEYS} | {"per_pos": per_pos}


def decode_window(outs) -> dict:
    """The decode phase of one generate call at its full batch: from the moment the last request got its first
    token (every prefill done) to the moment the first request got its last (with speculation, requests of the
    same length finish at different steps, and the tail of a closed batch would run at a smaller batch than the
    one measured; a server's continuous batching fills those places). Tokens and engine steps (distinct token
    times) inside it; seq_steps counts a step once for every sequence that got tokens in it."""
    times = [o.metrics["token_times"] for o in outs]
    t0, t1 = max(t[0] for t in times), min(t[-1] for t in times)
    inside = [[x for x in t if t0 < x <= t1] for t in times]
    after = [[x for x in t if x > t0] for t in times]     # every decode step, the tail included
    return dict(tokens=sum(map(len, inside)), seconds=t1 - t0, steps=len({x for t in inside for x in t}),
                seq_steps=sum(len(set(t)) for t in inside), all_tokens=sum(map(len, after)),
                all_seq_steps=sum(len(set(t)) for t in after))


def generate(llm: LLM, prompts, params) -> dict:
    """One timed generate call: its decode window, outputs, and what speculation did in it."""
    before = spec_counts(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = spec_counts(llm)
    spec = {key: after[key] - before[key] for key in SPEC_KEYS}
    spec["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
    return decode_window(outs) | dict(outputs=[o.outputs[0].token_ids for o in outs], spec=spec)


def interleaved(llms: dict[str, LLM], prompt_sets: list[list[list[int]]], params, rounds: int) -> dict:
    """Every engine on every prompt set, one generate call each, over `rounds`; the engines one after the other
    on the same set, in an order rotated from set to set and round to round. After one untimed call of each
    engine on each set (warm-up; the prefix cache then holds the prompts for all alike).

    Returns per engine: `rounds` (per round: tokens, seconds, steps, seq_steps summed over the sets), `spec`
    (speculation counts of the first timed round: greedy decoding makes every round the same), and
    `identical` (sets whose outputs equal the first engine's, over all rounds, out of `checked`), `outputs`
    (each set's token ids, first round)."""
    names = list(llms)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for prompts in prompt_sets:
        for name in names:
            llms[name].generate(prompts, warm, use_tqdm=False)
    res = {n: dict(rounds=[], spec=None, identical=0, checked=0, outputs=[]) for n in names}
    for r in range(rounds):
        totals = {n: dict(tokens=0, seconds=0.0, steps=0, seq_steps=0, all_tokens=0, all_seq_steps=0) for n in names}
        spec = {n: dict.fromkeys(SPEC_KEYS, 0) | {"per_pos": []} for n in names}
        for i, prompts in enumerate(prompt_sets):
            shift = (r * len(prompt_sets) + i) % len(names)
            runs = {n: generate(llms[n], prompts, params) for n in names[shift:] + names[:shift]}
            for n, run in runs.items():
                for key in totals[n]:
                    totals[n][key] += run[key]
                for key in SPEC_KEYS:
                    spec[n][key] += run["spec"][key]
                pp = run["spec"]["per_pos"]
                spec[n]["per_pos"] = [a + b for a, b in zip(spec[n]["per_pos"] or [0] * len(pp), pp)]
                res[n]["identical"] += run["outputs"] == runs[names[0]]["outputs"]
                res[n]["checked"] += 1
                if r == 0:
                    res[n]["outputs"].append(run["outputs"])
        for n in names:
            res[n]["rounds"].append(totals[n])
            if res[n]["spec"] is None:
                res[n]["spec"] = spec[n]
    return res


def summarize(res: dict, base: str = "base") -> dict:
    """Per engine: median decode tokens/s over rounds, the median of the rounds' paired ratios to `base`, the
    median step; over the first round's whole decode (tail included, as the speculation counters count it):
    tokens per sequence-step, and (speculating engines) alpha, the share of sequence-steps that carried drafts,
    the mean draft length, tokens per verify step, and the acceptance at each position."""
    out = {}
    for name, r in res.items():
        tps = [x["tokens"] / x["seconds"] for x in r["rounds"]]
        base_tps = [x["tokens"] / x["seconds"] for x in res[base]["rounds"]]
        first, s = r["rounds"][0], r["spec"]
        row = dict(tokens_per_s=statistics.median(tps), tokens_per_s_rounds=[round(x, 1) for x in tps],
                   ratio=statistics.median(a / b for a, b in zip(tps, base_tps)),
                   ratio_rounds=[round(a / b, 3) for a, b in zip(tps, base_tps)],
                   step_s=statistics.median(x["seconds"] / x["steps"] for x in r["rounds"]),
                   tokens_per_seq_step=first["all_tokens"] / first["all_seq_steps"],
                   identical_outputs=f"{r['identical']}/{r['checked']}")
        if s["spec_decode_num_draft_tokens"]:
            drafts = s["spec_decode_num_drafts"]
            row |= dict(alpha=s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"],
                        draft_share=drafts / first["all_seq_steps"],
                        mean_draft_len=s["spec_decode_num_draft_tokens"] / drafts,
                        tokens_per_verify=1 + s["spec_decode_num_accepted_tokens"] / drafts,
                        accepted_at_pos=[round(a / drafts, 3) for a in s["per_pos"]])
        out[name] = row
    return out


# --- the model ------------------------------------------------------------------------------------------

def expected_tokens(alpha: float, k: float) -> float:
    """Leviathan et al.: tokens per verify step when each of k drafts is accepted with probability alpha,
    independently, until the first rejection, plus the target's own token: (1 - alpha^(k+1)) / (1 - alpha)."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def forward_seconds(llm: LLM, batch: int, m: int, context: int) -> float:
    """One forward of `batch` sequences with `m` new tokens each after `context` cached ones, logits at all m
    (what a verify step computes). On an engine that serves nothing: it writes its pool's first blocks."""
    runner, bs = llm.engine.runner, llm.engine.config.block_size
    nb = -(-(context + m) // bs)
    plan = StepPlan([[1] * m for _ in range(batch)], [context] * batch,
                    [list(range(i * nb, (i + 1) * nb)) for i in range(batch)], list(range(batch)))
    t0 = time.perf_counter()
    runner.forward(plan, [m] * batch)
    return time.perf_counter() - t0


def step_costs(args, batches: list[int], ms: list[int], repeats: int) -> dict:
    """Median forward seconds of the target with m new tokens per sequence (each m in ms) and of the draft with
    one, per batch, mid-generation (input_len + max_tokens/2 cached); the configurations of one batch interleaved
    within each repeat (one batch at a time: a large batch's forward would evict a small one's weights from the
    cache, which the engine running that batch never does). {("target"|"draft", batch, m): seconds}."""
    context = args.input_len + args.max_tokens // 2
    blocks = max(batches) * -(-(context + max(ms)) // 16) + 16
    probe = {"target": LLM(device=args.device, dtype="float32", num_kv_blocks=blocks, enable_prefix_caching=False),
             "draft": LLM(COURSE_DRAFT_MODEL, device=args.device, dtype="float32", num_kv_blocks=blocks,
                          enable_prefix_caching=False)}
    out = {}
    for b in batches:
        jobs = [("target", b, m) for m in ms] + [("draft", b, 1)]
        samples = {j: [] for j in jobs}
        for j in jobs:                               # warm-up
            forward_seconds(probe[j[0]], j[1], j[2], context)
        for i in range(repeats):
            for j in jobs[i % len(jobs):] + jobs[:i % len(jobs)]:
                samples[j].append(forward_seconds(probe[j[0]], j[1], j[2], context))
        out |= {j: statistics.median(s) for j, s in samples.items()}
    return out


def lookup_seconds(outputs: list[list[int]], prompts: list[list[int]], k: int, lookup) -> float:
    """Mean seconds of one n-gram lookup for one sequence, over every decode position of the given outputs."""
    proposer = NgramProposer(k, *lookup)
    seqs = [SimpleNamespace(token_ids=p + o[:j]) for p, o in zip(prompts, outputs) for j in range(1, len(o))]
    t0 = time.perf_counter()
    for s in seqs:
        proposer.propose([s], [k])
    return (time.perf_counter() - t0) / len(seqs)


def copy_sources(prompts: list[list[int]], outputs: list[list[int]], lookup) -> dict:
    """Where prompt lookup's right guesses come from: at every decode position of the (greedy) outputs, the match
    `NgramProposer` would use (the latest earlier occurrence of the longest suffix, lookup[1] down to lookup[0]
    tokens), whether its first proposed token is the right one, and whether the match lies in the prompt or in
    the output written so far. Fractions of all positions."""
    n_min, n_max = lookup
    counts = dict(positions=0, no_match=0, right_from_prompt=0, right_from_output=0, prompt_only_right=0)
    for prompt, out in zip(prompts, outputs):
        for j in range(1, len(out)):
            seq, at, at_prompt = prompt + out[:j], None, None
            for n in range(min(n_max, len(seq) - 1), n_min - 1, -1):
                starts = [s for s in range(len(seq) - n - 1, -1, -1) if seq[s:s + n] == seq[-n:]]
                at = at if at is not None or not starts else starts[0] + n
                in_prompt = [s + n for s in starts if s + n < len(prompt)]
                at_prompt = at_prompt if at_prompt is not None or not in_prompt else in_prompt[0]
            counts["positions"] += 1
            counts["no_match"] += at is None
            if at is not None and seq[at] == out[j]:
                counts["right_from_prompt" if at < len(prompt) else "right_from_output"] += 1
            counts["prompt_only_right"] += at_prompt is not None and seq[at_prompt] == out[j]
    return {k: v / counts["positions"] for k, v in counts.items() if k != "positions"}


def interp(costs: dict, batch: int, m: float) -> float:
    """The target's forward seconds at a fractional m, linear between the measured m's around it."""
    ms = sorted(mm for (who, b, mm) in costs if who == "target" and b == batch)
    lo = max([x for x in ms if x <= m], default=ms[0])
    hi = min([x for x in ms if x >= m], default=ms[-1])
    if hi == lo:
        return costs[("target", batch, lo)]
    w = (m - lo) / (hi - lo)
    return (1 - w) * costs[("target", batch, lo)] + w * costs[("target", batch, hi)]


def model_row(method: str, k: int, batch: int, row: dict, base_step_s: float, costs: dict, lookup_s: float) -> dict:
    """The speed-up of one measured configuration as tokens per step over the cost of a step (in plain steps),
    predicted two ways, and measured:

    - Leviathan: E(alpha, k) / (r + c k + c0), every step carrying k drafts, each accepted with alpha
      independently of the others;
    - step mix: the measured tokens per sequence-step / (1 + c0 + share (r(L) - 1 + c L)), with the share of
      steps that carried drafts and their mean length L (n-gram lookup finds no match, or a short one, often);
    - measured: the speed-up, and the spec engine's median step over the base engine's (the cost, measured).

    From the forwards timed on their own at this batch: r(m) = forward(m new tokens a sequence) / forward(1),
    c = the draft's forward / the target's; c0 = the n-gram lookup (every step, every sequence) over the base
    engine's step; 0 for the draft model."""
    t1 = costs[("target", batch, 1)]
    r = lambda m: interp(costs, batch, m) / t1
    c = costs[("draft", batch, 1)] / t1 if method == "draft" else 0.0
    c0 = batch * lookup_s / base_step_s if method == "ngram" else 0.0
    E = expected_tokens(row["alpha"], k)
    share, length = row["draft_share"], row["mean_draft_len"]
    cost_leviathan = r(k + 1) + c * k + c0
    cost_mix = 1 + c0 + share * (r(length + 1) - 1 + c * length)
    return dict(r=r(k + 1), c=c, c0=c0, alpha=row["alpha"], E=E, tokens_per_step=row["tokens_per_seq_step"],
                draft_share=share, cost_leviathan=cost_leviathan, cost_mix=cost_mix,
                cost_measured=row["step_s"] / base_step_s, predicted_leviathan=E / cost_leviathan,
                predicted_mix=row["tokens_per_seq_step"] / cost_mix, measured=row["ratio"])


# --- the parts ------------------------------------------------------------------------------------------

def part_batch1(args, prompts, params) -> dict:
    ks = {"ngram": args.k_ngram, "draft": args.k_draft}
    llms = {"base": make_llm("base", 0, args, 1)} | {m: make_llm(m, ks[m], args, 1) for m in METHODS}
    res = interleaved(llms, [[p] for p in prompts], params, args.rounds)
    rows = summarize(res)
    print(f"\n1. batch 1: {len(prompts)} code prompts of {args.input_len} tokens, {args.max_tokens} new tokens, "
          f"{args.rounds} rounds")
    print(f"{'':22s} {'tok/s':>7s} {'vs base':>8s} {'alpha':>6s} {'tok/step':>8s} {'identical':>10s}")
    for name, r in rows.items():
        label = name if name == "base" else f"{name} k={ks[name]}" + (f" lookup {args.lookup[0]}-{args.lookup[1]}"
                                                                      if name == "ngram" else "")
        print(f"{label:22s} {r['tokens_per_s']:7.1f} {r['ratio']:7.2f}x {r.get('alpha', 0):6.2f} "
              f"{r['tokens_per_seq_step']:8.2f} {r['identical_outputs']:>10s}")
    src = copy_sources(prompts, [o[0] for o in res["base"]["outputs"]], args.lookup)
    print(f"prompt lookup's first guess: right at {src['right_from_output']:.0%} of positions copying the model's own "
          f"output, at {src['right_from_prompt']:.0%} copying the prompt (a lookup in the prompt alone: right at "
          f"{src['prompt_only_right']:.0%})")
    return dict(k=ks, rows=rows, outputs=res, copy_sources=src)


def part_k_sweep(args, prompts, params) -> dict:
    llms = {"base": make_llm("base", 0, args, 1)}
    for m in METHODS:
        for k in args.ks:
            llms[f"{m} k={k}"] = make_llm(m, k, args, 1)
    rows = summarize(interleaved(llms, [[p] for p in prompts], params, args.sweep_rounds))
    print(f"\n2. against k: {len(prompts)} prompts, {args.sweep_rounds} rounds "
          f"(base {rows['base']['tokens_per_s']:.1f} tok/s)")
    print(f"{'':12s} {'alpha':>6s} {'E(a,k)':>7s} {'tok/step':>8s} {'drafted':>8s} {'vs base':>8s} {'identical':>10s}")
    for name, r in rows.items():
        if name != "base":
            k = int(name.split("=")[1])
            print(f"{name:12s} {r['alpha']:6.2f} {expected_tokens(r['alpha'], k):7.2f} {r['tokens_per_seq_step']:8.2f} "
                  f"{r['draft_share']:8.0%} {r['ratio']:7.2f}x {r['identical_outputs']:>10s}")
    return rows


def part_batch_sweep(args, windows, params) -> dict:
    """Each batch size on the same prompts where it can: max(batch, --batch-prompts) of them, in sets of `batch`
    decoding together (so acceptance is the same at every batch up to that number, and only the step changes)."""
    ks = {"ngram": args.k_ngram, "draft": args.k_draft}
    print(f"\n3. against the batch: max(batch, {args.batch_prompts}) prompts in sets of the batch, decoding together; "
          f"{args.batch_rounds} rounds")
    print(f"{'batch':>5s} {'base tok/s':>10s} " + " ".join(f"{m + ' vs base':>14s}" for m in METHODS))
    rows, below = {}, {m: None for m in METHODS}
    for b in args.batches:
        llms = {"base": make_llm("base", 0, args, b)} | {m: make_llm(m, ks[m], args, b) for m in METHODS}
        n = max(b, args.batch_prompts)
        s = summarize(interleaved(llms, [windows[i:i + b] for i in range(0, n, b)], params, args.batch_rounds))
        rows[b] = s
        print(f"{b:5d} {s['base']['tokens_per_s']:10.1f} " + " ".join(f"{s[m]['ratio']:13.2f}x" for m in METHODS))
        for m in METHODS:
            if below[m] is None and s[m]["ratio"] < 1:
                below[m] = b
        del llms
        if all(below.values()) and b >= 2 * max(below.values()) and b != args.batches[-1]:
            print(f"   both below 1x since batch {max(below.values())}: stopping")
            break
    return rows


def part_model(args, b1: dict, ks_rows: dict, batch_rows: dict, windows) -> tuple[dict, dict, dict]:
    """4. Step costs measured on their own, and each measured configuration's predicted speed-up beside it."""
    batches = sorted({1} | set(batch_rows))
    ms = sorted({1} | {k + 1 for k in args.ks} | {args.k_draft + 1} | set(range(1, args.k_ngram + 2)))
    costs = step_costs(args, batches, ms, repeats=15 if not args.quick else 5)
    outs = [o[0] for o in b1["outputs"]["base"]["outputs"]]
    lookup_s = {k: lookup_seconds(outs, windows[:args.prompts], k, args.lookup)
                for k in sorted(set(args.ks) | {args.k_ngram})}
    base_step = b1["rows"]["base"]["step_s"]
    t1 = costs[("target", 1, 1)]
    print(f"\n4. the model: forwards timed on their own (batch 1: one token {t1 * 1e3:.2f} ms; "
          f"a plain engine step {base_step * 1e3:.2f} ms)")
    print("   target forward of m new tokens / of 1: "
          + ", ".join(f"m={m}: {costs[('target', 1, m)] / t1:.2f}" for m in ms))
    print(f"   draft forward / target forward: {costs[('draft', 1, 1)] / t1:.2f};  "
          f"n-gram lookup: {lookup_s[args.k_ngram] * 1e6:.0f} us a sequence a step")
    model = {}
    for m in METHODS:
        k = b1["k"][m]
        model[f"batch1 {m} k={k}"] = model_row(m, k, 1, b1["rows"][m], base_step, costs, lookup_s.get(k, 0.0))
    for name, row in ks_rows.items():
        if name != "base":
            m, k = name.split()[0], int(name.split("=")[1])
            model[f"k sweep {name}"] = model_row(m, k, 1, row, ks_rows["base"]["step_s"], costs, lookup_s.get(k, 0.0))
    for b, rows in batch_rows.items():
        for m in METHODS:
            k = b1["k"][m]
            model[f"batch {b} {m} k={k}"] = model_row(m, k, b, rows[m], rows["base"]["step_s"], costs,
                                                     lookup_s.get(k, 0.0))
    print("   tokens per step: E(alpha, k) assumed, measured; a step's cost in base steps: r + ck + c0 (Leviathan),")
    print("   by the step mix, measured; the speed-up: predicted (Leviathan), predicted (step mix), measured")
    print(f"{'':22s} {'alpha':>5s} {'r':>5s} {'c':>5s} {'E':>5s} {'tok/st':>6s} {'cost L':>6s} {'mix':>5s} "
          f"{'meas':>5s} {'Leviathan':>9s} {'mix':>6s} {'measured':>8s}")
    for name, r in model.items():
        print(f"{name:22s} {r['alpha']:5.2f} {r['r']:5.2f} {r['c']:5.2f} {r['E']:5.2f} {r['tokens_per_step']:6.2f} "
              f"{r['cost_leviathan']:6.2f} {r['cost_mix']:5.2f} {r['cost_measured']:5.2f} "
              f"{r['predicted_leviathan']:8.2f}x {r['predicted_mix']:5.2f}x {r['measured']:7.2f}x")
    return costs, lookup_s, model


def break_even(rows: dict, method: str) -> float | None:
    """The batch where the speed-up crosses 1x, interpolated in log2(batch); None if it never was above, inf if
    it never went below."""
    pts = [(b, r[method]["ratio"]) for b, r in rows.items()]
    if pts[0][1] < 1:
        return None
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if s0 >= 1 > s1:
            x = math.log2(b0) + (s0 - 1) / (s0 - s1) * (math.log2(b1) - math.log2(b0))
            return 2 ** x
    return math.inf


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, help="prompt tokens (a window of held-out source)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (ignore_eos, greedy)")
    ap.add_argument("--prompts", type=int, help="prompts in the batch-1 comparison")
    ap.add_argument("--rounds", type=int, help="rounds of the batch-1 comparison")
    ap.add_argument("--k-ngram", type=int, default=4, help="num_speculative_tokens of the ngram method")
    ap.add_argument("--k-draft", type=int, default=3, help="num_speculative_tokens of the draft_model method")
    ap.add_argument("--lookup", type=int, nargs=2, default=[1, 4], metavar=("MIN", "MAX"),
                    help="the ngram method's prompt_lookup_min and _max")
    ap.add_argument("--ks", type=int, nargs="+", help="the k sweep")
    ap.add_argument("--sweep-prompts", type=int, help="prompts in the k sweep")
    ap.add_argument("--sweep-rounds", type=int)
    ap.add_argument("--batches", type=int, nargs="+", help="the batch sweep (stops once both methods are below 1x)")
    ap.add_argument("--batch-prompts", type=int, help="prompts at each batch size below it (in sets of the batch)")
    ap.add_argument("--batch-rounds", type=int)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["k", "batch"], help="parts to leave out")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0, help="the order of the held-out files the prompts are cut from")
    ap.add_argument("--quick", action="store_true", help="a test-size run (under a minute)")
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"), help="directory for the JSON record")
    args = ap.parse_args(argv)
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    trained = min(json.loads((Path(m) / "training.json").read_text())["seq_len"]
                  for m in (COURSE_MODEL, COURSE_DRAFT_MODEL))
    if args.input_len + args.max_tokens > trained:
        print(f"warning: prompt + output = {args.input_len + args.max_tokens} tokens, past the {trained} the course "
              f"models were trained on: their text degrades there (loops), and acceptance with it")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    n = max(args.prompts, args.sweep_prompts, max(args.batches), args.batch_prompts)
    windows = code_prompts(n, args.input_len, args.seed)
    print(f"COURSE_MODEL ({args.device}, float32), the peer: the same engine without speculation; "
          f"{torch.get_num_threads()} threads")

    b1 = part_batch1(args, windows[:args.prompts], params)
    ks_rows = {} if "k" in args.skip else part_k_sweep(args, windows[:args.sweep_prompts], params)
    batch_rows = {} if "batch" in args.skip else part_batch_sweep(args, windows, params)

    costs, lookup_s, model = part_model(args, b1, ks_rows, batch_rows, windows)

    best = max(METHODS, key=lambda m: b1["rows"][m]["ratio"])
    ratio = b1["rows"][best]["ratio"]
    even = {m: break_even(batch_rows, m) for m in METHODS} if batch_rows else {}
    print(f"\nbatch 1, the better method: {best}, {ratio:.2f}x the base engine's decode tokens/s "
          f"(alpha {b1['rows'][best]['alpha']:.2f})  target >= {TARGET:g}x: {'PASS' if ratio >= TARGET else 'FAIL'}")
    for m, e in even.items():
        print(f"{m}: " + ("below 1x already at batch 1" if e is None else "above 1x at every batch swept"
                           if e == math.inf else f"break-even at batch {e:.1f}"))
    print(f"wall time {time.perf_counter() - t_start:.0f} s")

    from nanoserve import __version__
    record = dict(benchmark="speculative", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  nanoserve=__version__, machine=machine_info(), model="COURSE_MODEL", draft="COURSE_DRAFT_MODEL",
                  device=args.device, dtype="float32", quick=args.quick,
                  workload=dict(prompts="held-out corpus windows (nanoserve.course.corpus validation files)",
                                input_len=args.input_len, max_tokens=args.max_tokens, greedy=True, ignore_eos=True,
                                seed=args.seed, batch1_prompts=args.prompts, rounds=args.rounds,
                                k_sweep_prompts=args.sweep_prompts, k_sweep_rounds=args.sweep_rounds,
                                batch_prompts=args.batch_prompts, batch_rounds=args.batch_rounds,
                                models_trained_on=trained),
                  settings=dict(k=b1["k"], prompt_lookup=list(args.lookup)), ngram_copy_sources=b1["copy_sources"],
                  batch1=b1["rows"], k_sweep=ks_rows,
                  batch_sweep={str(b): r for b, r in batch_rows.items()},
                  break_even_batch={m: (None if e is None else "never" if e == math.inf else round(e, 2))
                                    for m, e in even.items()},
                  step_costs={f"{w} batch={b} m={m}": s for (w, b, m), s in costs.items()},
                  ngram_lookup_s=lookup_s, prediction=model, best=best, ratio=round(ratio, 3), target=TARGET,
                  met=ratio >= TARGET)
    save_record(record, args.save, "speculative-quick" if args.quick else "speculative")
    return record


if __name__ == "__main__":
    main()
