"""Goodput at an SLO (chapter 11): the highest request rate at which a service still meets its objective.

Rates sit on a ladder, RUNG times apart (1, 1.25, 1.56, ... req/s), so "the highest rate that meets the SLO" is
a rung: the **knee**. A run meets the SLO when every request completed and its TTFT and TPOT at the PERCENTILE-th
percentile are within the bounds. That percentile is 90: a run short enough for a notebook (a few dozen requests)
has no p99 to speak of (it is its worst request, and one hiccup of a shared machine decides it); a benchmark with
thousands of requests per rate can hold a p99. The model's knee (`predicted_knee`, from `simulate`) and the measured one (`measure_knee`, from the
load client against a running server) are found the same way, so they can be compared rung for rung.
"""
from __future__ import annotations

import math

from nanoserve.serve import simulate
from nanoserve.serve.load import run_load

RUNG = 1.25
PERCENTILE = 90
RUN_SECONDS = 2.0     # a run offers about this many seconds of arrivals, so a high rate is a load, not a burst
LEAST_REQUESTS = 20
# How far apart two knees land with nothing between them: identical servers measured side by side (`measure_knees`,
# runs of RUN_SECONDS, a 2-core CPU) landed within one rung of each other in 25 of 28 pairs, two rungs apart in the
# other 3 (either way); a chapter 11 run on a slowed host once put a lever that changes nothing three rungs low.
# A lever that moves a knee by no more than this is within the noise; measured one after the other, not side by
# side, the same servers drifted by two rungs, so compare configurations side by side.
NOISE_RUNGS = 1


def rate(k: int) -> float:
    """The ladder's k-th rate, in requests per second."""
    return RUNG ** k


def rung_of(r: float) -> int:
    """The highest rung at or below rate r."""
    return math.floor(math.log(r) / math.log(RUNG) + 1e-9)


def run_of(trace, k: int):
    """The requests a run at rung k replays: the trace's first ones, RUN_SECONDS of arrivals at that rate (at least
    LEAST_REQUESTS, at most the whole trace)."""
    return trace.head(min(len(trace), max(LEAST_REQUESTS, round(rate(k) * RUN_SECONDS))))


def meets(summary: dict, slo: dict) -> bool:
    """Whether a run (the load client's summary, or simulate.summary's) met the SLO: nothing failed, and TTFT and
    TPOT at the PERCENTILE-th percentile within their bounds (ms)."""
    p = PERCENTILE
    return (not summary.get("failed")) and summary[f"p{p}_ttft_ms"] <= slo["ttft"] and summary[f"p{p}_tpot_ms"] <= slo["tpot"]


def predicted_knee(prompt_ids, trace, cost: simulate.StepCost, config: simulate.Config, slo: dict,
                   lowest: int = 0, highest: int = 40) -> int:
    """The model's knee: climbing the ladder from `lowest`, the last rung before the first one the simulated run
    misses (`lowest - 1` if even that one misses). prompt_ids: every trace request's token ids."""
    k = lowest
    while k <= highest:
        run_trace = run_of(trace, k)
        run = simulate.simulate(prompt_ids[:len(run_trace)], run_trace.max_tokens, run_trace.send_times(rate(k)),
                                cost, config)
        if not meets(simulate.summary(run), slo):
            break
        k += 1
    return k - 1


async def measure_knee(url: str, trace, slo: dict, start: int, max_runs: int = 5, model: str = "course") -> dict:
    """The measured knee, searched from rung `start` (the model's knee): up while runs meet the SLO, down while
    they miss, until the answer is bracketed or `max_runs` runs are spent. Returns {"knee": rung or None (not
    bracketed), "runs": {rung: the run's summary with "meets"}}."""
    return (await measure_knees({"one": url}, trace, slo, {"one": start}, max_runs, model))["one"]


async def measure_knees(urls: dict[str, str], trace, slo: dict, starts: dict[str, int], max_runs: int = 5,
                        model: str = "course") -> dict[str, dict]:
    """`measure_knee` for several servers at once, their runs taken in turns (one run of each, then the next of
    each), so configurations that are compared met the same moments of a shared machine: a few seconds of a busy
    neighbour slow them all, not one. Returns {name: {"knee", "runs"}}."""
    runs: dict[str, dict[int, dict]] = {name: {} for name in urls}
    nxt = dict(starts)                       # each server's next rung; None once its knee is bracketed
    for _ in range(max_runs):
        for name, url in urls.items():
            k = nxt[name]
            if k is None:
                continue
            run_trace = run_of(trace, k)
            s = await run_load(url, model, run_trace.prompts, max_tokens=run_trace.max_tokens,
                               send_at=run_trace.send_times(rate(k)), slo=slo)
            s["meets"] = meets(s, slo)
            runs[name][k] = s
            done = (k + 1) in runs[name] if s["meets"] else (k - 1) in runs[name]
            nxt[name] = None if done else (k + 1 if s["meets"] else k - 1)
        if all(k is None for k in nxt.values()):
            break
    out = {}
    for name, by_rung in runs.items():
        met = [j for j, s in by_rung.items() if s["meets"]]
        knee = max(met) if met and max(met) + 1 in by_rung else None   # the highest met rung, the one above missed
        out[name] = {"knee": knee, "runs": by_rung}
    return out


async def judge_lever(base_url: str, lever_url: str, trace, slo: dict, base_knee: int, lever_knee: int,
                      model: str = "course") -> dict:
    """Whether a lever pays: its knee's gain over its base's, in rungs, must reach the line, NOISE_RUNGS + 1.
    A gain of exactly the line is one that noise also gives now and then (identical servers side by side land two
    rungs apart in about one pair in ten, either way), so such a lever is measured again, both servers side by
    side from their knees, and kept only if the second gain reaches the line too. Other gains are decided at once.
    Returns {"gains": [rungs, ...], "kept": bool, "again": the second measurement (`measure_knees`' answer) or None}."""
    line = NOISE_RUNGS + 1
    gains, again = [lever_knee - base_knee], None
    if gains[0] == line:
        again = await measure_knees({"base": base_url, "lever": lever_url}, trace, slo,
                                    {"base": base_knee, "lever": lever_knee}, model=model)
        bracketed = again["base"]["knee"] is not None and again["lever"]["knee"] is not None
        gains.append(again["lever"]["knee"] - again["base"]["knee"] if bracketed else None)
    return {"gains": gains, "kept": all(g is not None and g >= line for g in gains), "again": again}
