"""Chapter 11's model of a serving engine (`serve.simulate`) against cases worked by hand, and the knee search of
`serve.slo` against a fake server whose SLO holds below a known rate."""
import asyncio

import pytest

from nanoserve.serve import simulate, slo
from nanoserve.serve.workload import Request, Trace, TraceSpec

COST = simulate.StepCost(batches=(1, 4), decode_s=(0.010, 0.016), prefill_s_per_token=0.001, request_s=0.005)


def run(prompts, max_tokens, sends, config):
    return simulate.simulate(prompts, max_tokens, sends, COST, config)


def test_one_request_alone_costs_its_way_in_its_prefill_and_a_step_per_token():
    (r,) = run([list(range(20))], [5], [0.0], simulate.Config(max_num_seqs=4))
    # reaches the engine after 5 ms; its prompt in one step: decode floor (batch 1) 10 ms + 20 tokens x 1 ms
    assert r["ttft_s"] == pytest.approx(0.005 + 0.010 + 0.020)
    assert r["tpot_s"] == pytest.approx(0.010)                      # then one decode of batch 1 per token
    assert r["e2el_s"] == pytest.approx(r["ttft_s"] + 4 * 0.010)


def test_a_full_batch_makes_the_next_request_wait_for_a_place():
    prompts = [list(range(100 * k, 100 * k + 8)) for k in range(2)]
    first, second = run(prompts, [3, 3], [0.0, 0.0], simulate.Config(max_num_seqs=1))
    assert second["ttft_s"] == pytest.approx(first["e2el_s"] + 0.010 + 0.008)   # admitted once the first finished
    both = run(prompts, [3, 3], [0.0, 0.0], simulate.Config(max_num_seqs=2))
    assert both[1]["ttft_s"] == pytest.approx(both[0]["ttft_s"])             # together, one step


def test_the_prefix_cache_skips_the_full_blocks_an_earlier_prompt_computed():
    system = list(range(40))                                      # two full blocks of 16, and 8 tokens more
    prompts = [system + [1000], system + [2000]]
    cached = run(prompts, [2, 2], [0.0, 1.0], simulate.Config(max_num_seqs=4, block_size=16))
    assert [r["cached_tokens"] for r in cached] == [0, 32]
    assert cached[1]["ttft_s"] == pytest.approx(0.005 + 0.010 + (41 - 32) * 0.001)
    plain = run(prompts, [2, 2], [0.0, 1.0], simulate.Config(max_num_seqs=4, enable_prefix_caching=False))
    assert [r["cached_tokens"] for r in plain] == [0, 0]


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks():
    steps = simulate.step_log([list(range(50))], [2], [0.0], COST,
                              simulate.Config(max_num_seqs=4, max_num_batched_tokens=20))
    assert [s["tokens"] for s in steps] == [20, 20, 10, 1]       # three chunks, then one decode
    assert max(s["tokens"] for s in steps) <= 20


def test_the_ladder_and_the_slo_check():
    assert slo.rate(0) == 1.0 and slo.rate(2) == pytest.approx(1.5625)
    assert slo.rung_of(slo.rate(7)) == 7 and slo.rung_of(slo.rate(7) * 1.1) == 7
    p = slo.PERCENTILE
    ok = {f"p{p}_ttft_ms": 100.0, f"p{p}_tpot_ms": 10.0, "failed": 0}
    assert slo.meets(ok, {"ttft": 100, "tpot": 10})
    assert not slo.meets(ok, {"ttft": 99, "tpot": 10}) and not slo.meets(ok, {"ttft": 100, "tpot": 9})
    assert not slo.meets(dict(ok, failed=1), {"ttft": 100, "tpot": 10})


def trace(n=240):
    spec = TraceSpec(num_requests=n)
    return Trace([Request(f"p{i}", 4, float(i), False, 8) for i in range(n)], spec)


def test_the_predicted_knee_falls_when_steps_cost_more():
    t = trace()
    ids = [list(range(8 * i, 8 * i + 8)) for i in range(len(t))]
    target = {"ttft": 60.0, "tpot": 20.0}
    fast = slo.predicted_knee(ids, t, COST, simulate.Config(max_num_seqs=1), target)
    slow_cost = simulate.StepCost((1, 4), (0.020, 0.032), 0.002, 0.005)
    slow = slo.predicted_knee(ids, t, slow_cost, simulate.Config(max_num_seqs=1), target)
    assert slow < fast
    more_room = slo.predicted_knee(ids, t, COST, simulate.Config(max_num_seqs=4), target)
    assert more_room > fast                                  # one at a time queues sooner than four at a time


@pytest.mark.parametrize("start", [3, 6, 9])
def test_the_measured_knee_is_bracketed_from_any_start(monkeypatch, start):
    knee = 6                                                  # the fake server meets the SLO up to rate(6)
    offered = []

    async def fake_run_load(url, model, prompts, max_tokens, send_at, slo):
        rate = (len(send_at) - 1) / send_at[-1]             # the trace's arrivals are one per second
        offered.append(rate)
        good = rate <= globals()["slo"].rate(knee) * 1.01
        p = globals()["slo"].PERCENTILE
        return {f"p{p}_ttft_ms": 1.0 if good else 1e6, f"p{p}_tpot_ms": 1.0, "failed": 0}

    monkeypatch.setattr(slo, "run_load", fake_run_load)
    out = asyncio.run(slo.measure_knee("http://x", trace(), {"ttft": 10, "tpot": 10}, start=start))
    assert out["knee"] == knee
    assert set(out["runs"]) >= {knee, knee + 1}
    assert len(out["runs"]) == abs(start - knee) + (2 if start <= knee else 1)   # one rung at a time, no more


def test_a_knee_not_bracketed_in_the_runs_allowed_is_none(monkeypatch):
    async def always_meets(url, model, prompts, max_tokens, send_at, slo):
        p = globals()["slo"].PERCENTILE
        return {f"p{p}_ttft_ms": 1.0, f"p{p}_tpot_ms": 1.0, "failed": 0}

    monkeypatch.setattr(slo, "run_load", always_meets)
    out = asyncio.run(slo.measure_knee("http://x", trace(), {"ttft": 10, "tpot": 10}, start=0, max_runs=3))
    assert out["knee"] is None and sorted(out["runs"]) == [0, 1, 2]


def _servers_with_knees(knees: dict, monkeypatch):
    """A fake load client: the server at a URL meets the SLO up to the rate of knees[URL]; returns the URLs it ran."""
    calls = []

    async def fake_run_load(url, model, prompts, max_tokens, send_at, slo):
        calls.append(url)
        rate = (len(send_at) - 1) / send_at[-1]
        good = rate <= globals()["slo"].rate(knees[url]) * 1.01
        p = globals()["slo"].PERCENTILE
        return {f"p{p}_ttft_ms": 1.0 if good else 1e6, f"p{p}_tpot_ms": 1.0, "failed": 0}

    monkeypatch.setattr(slo, "run_load", fake_run_load)
    return calls


def test_several_servers_are_measured_in_turns(monkeypatch):
    order = _servers_with_knees({"http://a": 4, "http://b": 7}, monkeypatch)
    out = asyncio.run(slo.measure_knees({"a": "http://a", "b": "http://b"}, trace(), {"ttft": 10, "tpot": 10},
                                        {"a": 5, "b": 6}))
    assert {name: r["knee"] for name, r in out.items()} == {"a": 4, "b": 7}
    assert order[:4] == ["http://a", "http://b", "http://a", "http://b"]   # one run of each, then the next
    assert order.count("http://a") == 2 and order.count("http://b") == 3


def test_the_models_view_of_a_servers_flags():
    from nanoserve.course import capstone
    assert capstone.config_of(capstone.DEPLOYED) == simulate.Config(max_num_seqs=4, enable_prefix_caching=False)
    assert capstone.config_of(["--max-num-batched-tokens", "512"]) == simulate.Config(max_num_batched_tokens=512)


@pytest.mark.parametrize("first, again, kept, measured_again", [
    (1, None, False, False),     # within the noise (NOISE_RUNGS): decided at once
    (3, None, True, False),      # past the line (NOISE_RUNGS + 1): decided at once
    (2, 2, True, True),          # on the line, where noise lands now and then: measured again, and it holds
    (2, 1, False, True),         # the second look does not see it: noise
])
def test_a_lever_whose_gain_lands_on_the_noise_line_is_measured_again(monkeypatch, first, again, kept, measured_again):
    base_knee = 5
    calls = _servers_with_knees({"http://base": base_knee, "http://lever": base_knee + (again or 0)}, monkeypatch)
    verdict = asyncio.run(slo.judge_lever("http://base", "http://lever", trace(), {"ttft": 10, "tpot": 10},
                                          base_knee, base_knee + first))
    assert verdict["kept"] is kept
    assert (len(verdict["gains"]) == 2) is measured_again and (verdict["again"] is not None) is measured_again
    assert verdict["gains"][0] == first and (not measured_again or verdict["gains"][1] == again)
    assert (len(calls) > 0) is measured_again
