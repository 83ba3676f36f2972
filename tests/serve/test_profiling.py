"""Profiling a running server (chapter 11): vLLM's /start_profile and /stop_profile, the files they write, and
`perf.server_profile`'s layers and joined trace; the shipped request trace and its replay by the load client.

The server runs in a subprocess on a free loopback port; every wait is bounded.
"""
import asyncio
import json
import sys

import httpx
import pytest

from nanoserve.perf import server_profile
from nanoserve.ports import free_port
from nanoserve.serve import workload
from nanoserve.serve.load import file_prompts, run_load, start_server

pytestmark = pytest.mark.slow
SERVE = [sys.executable, "-m", "nanoserve", "serve", "--host", "127.0.0.1", "--max-num-seqs", "8",
         "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A server with --profile-dir, and one profile of 6 trace requests replayed at 30 req/s."""
    out = tmp_path_factory.mktemp("profiles")
    port = free_port()
    with start_server(SERVE + ["--port", str(port), "--profile-dir", str(out)], port) as url:
        early = httpx.post(f"{url}/stop_profile", timeout=30)
        assert httpx.post(f"{url}/start_profile", timeout=30).json() == {"status": "profiling"}
        again = httpx.post(f"{url}/start_profile", timeout=30)
        trace = workload.load_trace().head(6)
        summary = asyncio.run(run_load(url, "course", trace.prompts, max_tokens=trace.max_tokens,
                                       send_at=trace.send_times(30.0), timeout_s=60))
        answer = httpx.post(f"{url}/stop_profile", timeout=60).json()
        after = httpx.post(f"{url}/v1/completions", json={"model": "course", "prompt": "x", "max_tokens": 2},
                           timeout=30)
        yield dict(early=early, again=again, summary=summary, answer=answer, after=after, dir=out)


def test_profile_routes_refuse_out_of_order_calls_and_the_server_keeps_serving(profiled):
    for response, says in ((profiled["early"], "no profile is running"), (profiled["again"], "already running")):
        assert response.status_code == 409 and says in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "ConflictError"
    assert profiled["summary"]["completed"] == 6 and profiled["summary"]["failed"] == 0
    assert profiled["after"].status_code == 200


def test_the_layers_account_for_the_window_and_the_joined_trace_has_both_threads(profiled, tmp_path):
    prof = server_profile.load(profiled["answer"])
    layers = prof.layers()
    assert set(layers) == set(server_profile.LAYERS) and all(v >= 0 for v in layers.values())
    on_engine_thread = layers["engine"] + layers["model"] + layers["kernels"] + layers["idle"]
    assert on_engine_thread == pytest.approx(prof.wall_s, rel=0.02)          # the loop thread's time, all of it
    assert layers["kernels"] > 0 and layers["API"] > 0
    assert len(prof.steps) >= max(profiled["summary"]["total_output_tokens"] // 6, 1)   # decode steps at least
    assert len(prof.forwards) == len(prof.steps)                             # one forward per step
    assert all(s.start_s >= prof.window[0] - 1e-3 and s.end_s <= prof.window[1] + 1e-3 for s in prof.steps)
    assert [r[2] for r in prof.requests].count("/v1/completions") == 6      # every request in the window, timed
    assert prof.kernel_flops() > 0
    path = prof.export_perfetto(tmp_path / "joined.json")
    events = json.loads(open(path).read())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {1, 2}
    # the joined trace puts each request's span around the steps that served it: the first step starts after
    # the first request arrived
    first_request = min(r[0] for r in prof.requests)
    assert prof.steps[0].start_s >= first_request


def test_without_a_profile_dir_the_routes_do_not_exist():
    port = free_port()
    with start_server(SERVE + ["--port", str(port)], port) as url:
        assert httpx.post(f"{url}/start_profile", timeout=30).status_code == 404


def test_the_shipped_trace_is_what_its_command_makes(tmp_path):
    made = workload.make_trace()
    shipped = workload.load_trace()
    assert shipped == made
    spec = shipped.spec
    assert len(shipped) == spec.num_requests
    assert all(spec.output_tokens[0] <= r.max_tokens <= spec.output_tokens[1] for r in shipped.requests)
    shared = sum(r.shared for r in shipped.requests) / len(shipped)
    assert abs(shared - spec.shared_fraction) < 0.08
    system = [r.prompt for r in shipped.requests if r.shared]
    prefix = system[0][:200]
    assert all(p.startswith(prefix) for p in system)                        # one system prompt, shared
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(shipped.requests, shipped.requests[1:])]
    assert min(gaps) >= 0 and abs(sum(gaps) / len(gaps) - 1.0) < 0.2      # Poisson at one request per second
    assert shipped.send_times(4.0)[-1] == pytest.approx(shipped.requests[-1].arrival_s / 4.0)
    prompts, sizes = file_prompts(workload.SHIPPED)          # bench-serve --prompts-file reads it too
    assert prompts == shipped.prompts and sizes == shipped.max_tokens


def test_a_bad_trace_file_names_itself(tmp_path):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="trace.jsonl: not a trace file"):
        workload.load_trace(bad)
    with pytest.raises(ValueError, match="rate"):
        workload.load_trace().send_times(0)
