"""The load client (nanoserve/serve/load.py): vLLM's metric definitions, SSE parsing, failures, arrivals; and the
naive peer server's greedy text against the offline engine's.

A scripted server runs in this process (uvicorn on a thread, a free loopback port) with known delays, so the
measured TTFT, ITL and TPOT can be checked against what it did; margins allow for a busy 2-core machine.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanoserve.ports import free_port
from nanoserve.serve.load import (RequestRecord, arrival_intervals, load, one_at_a_time_waits,
                                  parse_goodput, send_times, start_server, summarize)

FIRST_S, GAP_S, TOKENS = 0.2, 0.05, 4   # the scripted stream: first text after 0.2 s, then 3 more 0.05 s apart


def scripted_app(state: dict) -> FastAPI:
    """/v1/completions by prompt: "ok" streams the script; "busy" answers 429; "cut" ends without [DONE];
    "hang" never answers. Counts requests in flight."""
    app = FastAPI()

    def event(body) -> str:
        return f"data: {json.dumps(body)}\n\n"

    async def script():
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            yield event({"choices": [{"index": 0, "text": ""}]})     # an empty chunk at once: no token yet
            yield ": a comment line, which SSE clients ignore\n\n"
            await asyncio.sleep(FIRST_S)
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(GAP_S)
                yield event({"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]})
            yield event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS,
                                                  "total_tokens": 3 + TOKENS}})
            yield "data: [DONE]\n\n"
        finally:
            state["in_flight"] -= 1

    async def cut():
        yield event({"choices": [{"index": 0, "text": "x"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        if body["prompt"] == "busy":
            return JSONResponse({"error": {"message": "the queue is full", "type": "rate_limit", "param": None,
                                           "code": 429}}, 429)
        if body["prompt"] == "hang":
            await asyncio.sleep(5)
        return StreamingResponse(cut() if body["prompt"] == "cut" else script(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake():
    state = {"in_flight": 0, "max_in_flight": 0, "bodies": []}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(scripted_app(state), host="127.0.0.1", port=port, log_level="warning",
                                          timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the scripted server did not start within 10 s"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def test_stream_timings_and_usage(fake):
    url, state = fake
    s = load(url, "m", ["ok", "ok", "ok"], max_tokens=TOKENS, api_key="k")
    assert (s["completed"], s["failed"], s["errors"]) == (3, 0, [])
    body = state["bodies"][-1]
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == TOKENS
    for r in s["requests"]:
        assert r["text"] == "t0 t1 t2 t3 " and r["completion_tokens"] == TOKENS and r["prompt_tokens"] == 3
        assert FIRST_S <= r["ttft"] < FIRST_S + 0.5, "the empty first chunk must not count as the first token"
        assert len(r["itl"]) == TOKENS - 1 and GAP_S * 0.5 <= np.mean(r["itl"]) < GAP_S + 0.3
        assert r["e2el"] == pytest.approx(r["ttft"] + sum(r["itl"]))
        assert r["tpot"] == pytest.approx((r["e2el"] - r["ttft"]) / (TOKENS - 1))
    assert s["total_output_tokens"] == 3 * TOKENS and s["total_input_tokens"] == 9
    assert s["output_throughput"] == pytest.approx(3 * TOKENS / s["duration"])
    assert s["median_ttft_ms"] >= FIRST_S * 1e3
    assert s["request_rate"] == "inf" and json.loads(json.dumps(s, allow_nan=False)) == s   # JSON-able


def test_failures_keep_their_message(fake):
    url, _ = fake
    s = load(url, "m", ["ok", "busy", "cut", "hang"], max_tokens=TOKENS, timeout_s=1.0)
    assert (s["completed"], s["failed"]) == (1, 3)
    assert sorted(s["errors"]) == sorted(["HTTP 429: the queue is full", "the stream ended before data: [DONE]",
                                          "timed out after 1.0 s"])
    assert s["mean_ttft_ms"] == pytest.approx(s["requests"][0]["ttft"] * 1e3), "failures stay out of latencies"


def test_max_concurrency_caps_requests_in_flight(fake):
    url, state = fake
    state["max_in_flight"] = 0
    s = load(url, "m", ["ok"] * 6, max_tokens=TOKENS, max_concurrency=2)
    assert s["completed"] == 6 and state["max_in_flight"] == 2
    assert s["duration"] >= 3 * (FIRST_S + (TOKENS - 1) * GAP_S), "three waves of two"


def test_requests_leave_on_the_arrival_schedule(fake):
    url, _ = fake
    s = load(url, "m", ["ok"] * 5, max_tokens=TOKENS, request_rate=10.0, seed=3)
    due = send_times(5, 10.0, 1.0, seed=3)
    sent = [r["sent"] for r in s["requests"]]
    assert all(d - 1e-3 <= t < d + 0.25 for t, d in zip(sent, due)), (sent, due)


def test_summary_definitions_and_goodput():
    a = RequestRecord("a", 5, ok=True, ttft=0.1, itl=[0.1] * 4, e2el=0.5, prompt_tokens=10, completion_tokens=5)
    b = RequestRecord("b", 1, ok=True, ttft=0.3, e2el=0.3, prompt_tokens=20, completion_tokens=1)
    c = RequestRecord("c", 5, error="HTTP 429: full")
    s = summarize([a, b, c], duration=2.0, slo={"ttft": 200, "tpot": 50})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 429: full"])
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 18.0
    assert a.tpot == pytest.approx(0.1) and b.tpot is None            # TPOT needs two tokens
    assert s["mean_tpot_ms"] == pytest.approx(100.0)                  # ...and only a's counts
    assert s["median_ttft_ms"] == pytest.approx(200.0) and s["p99_ttft_ms"] == pytest.approx(298.0)
    assert s["mean_itl_ms"] == pytest.approx(100.0) and s["p90_e2el_ms"] == pytest.approx(480.0)
    assert s["request_goodput"] == 0.0    # a misses tpot (100 > 50), b misses ttft (300 > 200)
    assert summarize([a, b, c], 2.0, {"ttft": 400})["request_goodput"] == 1.0    # both; c failed
    assert summarize([a, b, c], 2.0, {"tpot": 50, "ttft": 400})["request_goodput"] == 0.5   # b's TPOT counts as 0
    assert summarize([a], 1.0)["request_goodput"] is None
    assert summarize([c], 1.0)["p99_e2el_ms"] == 0.0


def test_goodput_argument():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="'itl'"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_goodput(["ttft"])


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_gamma_mean_and_spread(burstiness):
    gaps = arrival_intervals(40_000, 8.0, burstiness, seed=1)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)   # gamma's CV: Poisson's is 1
    assert np.array_equal(gaps, arrival_intervals(40_000, 8.0, burstiness, seed=1))
    assert not np.array_equal(gaps, arrival_intervals(40_000, 8.0, burstiness, seed=2))


def test_one_at_a_time_waits():
    # arrivals at 0, 0.5, 0.6 and 5 for a server taking 1 each: the second waits until 1, the third until 2,
    # the fourth finds it idle
    assert one_at_a_time_waits([0.0, 0.5, 0.6, 5.0], 1.0) == pytest.approx([0.0, 0.5, 1.4, 0.0])
    # past capacity the line only grows: 3x the rate one server drains, and the last wait is many services long
    waits = one_at_a_time_waits(send_times(60, 3.0, seed=1), 1.0)
    assert waits[-1] > 30 and waits[-1] == waits.max()
    with pytest.raises(ValueError, match="service_s"):
        one_at_a_time_waits([0.0], 0.0)


def test_arrivals_infinite_rate_and_bad_arguments():
    assert not send_times(4, float("inf")).any()
    assert send_times(3, 2.0)[0] == 0.0
    with pytest.raises(ValueError, match="request_rate"):
        arrival_intervals(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_intervals(3, 1.0, burstiness=0)
    with pytest.raises(ValueError, match="one per prompt"):
        load("http://127.0.0.1:1", "m", ["a", "b"], max_tokens=[1])


def test_start_server_reports_a_server_that_died():
    cmd = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="(?s)code 3.*cannot load the model"):
        with start_server(cmd, free_port(), timeout_s=20):
            pass


@pytest.mark.slow
def test_naive_server_greedy_text_is_the_engines():
    from nanoserve import LLM, SamplingParams
    prompt = "def fibonacci(n):\n    "
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.serve.naive", "--port", str(port), "--served-model-name", "course"]
    with start_server(cmd, port, timeout_s=120) as url:
        s = load(url, "course", [prompt], max_tokens=16)
        plain = httpx.post(f"{url}/v1/completions", json={"model": "course", "prompt": prompt, "max_tokens": 16,
                                                          "temperature": 0}, timeout=60).json()
        wrong = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": prompt}, timeout=60)
    llm = LLM()
    ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    plain_ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert s["completed"] == 1 and s["requests"][0]["completion_tokens"] == 16
    assert s["requests"][0]["text"] == ours.outputs[0].text
    assert plain["choices"][0]["text"] == plain_ours.outputs[0].text
    assert plain["usage"]["completion_tokens"] == len(plain_ours.outputs[0].token_ids)
    assert plain["choices"][0]["finish_reason"] == plain_ours.outputs[0].finish_reason
    assert wrong.status_code == 404 and "'other'" in wrong.json()["error"]["message"]
