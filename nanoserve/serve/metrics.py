"""/metrics in Prometheus' text format, with vLLM's metric names, so a dashboard built for vLLM reads ours.

Two kinds of number. The engine's state (requests running and waiting, KV cache usage, prefix-cache
counters) is read at scrape time from the snapshot the engine loop publishes after every step, never from
the engine itself, which only its own thread touches. Per-request numbers (tokens, TTFT, inter-token
latency, end-to-end latency, time queued) are recorded when a request finishes, from the times the engine
stamped on it. Every series carries a `model_name` label, as vLLM's do. Each server has its own registry,
so two servers in one process (the tests) do not share counters.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; vLLM's buckets are similar: fine below a second, coarse above
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _EngineState:
    """Gauges and counters read from the engine loop's published snapshot at each scrape."""

    def __init__(self, front, model_name: str):
        self.front, self.labels = front, {"model_name": model_name}

    def _one(self, family, value):
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        s, names = self.front.snapshot, list(self.labels)
        yield self._one(GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch.",
                                          labels=names), s["num_running"])
        # requests accepted but not yet admitted: the engine's waiting queue and those on their way to it
        yield self._one(GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                                          labels=names), s["num_waiting"] + self.front.num_in_flight())
        yield self._one(GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of the KV cache blocks in use "
                                          "(1 = full).", labels=names), s["kv_cache_usage"])
        yield self._one(CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache.", labels=names), s["prefix_cache_queries"])
        yield self._one(CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                            labels=names), s["prefix_cache_hits"])
        yield self._one(CounterMetricFamily("vllm:num_preemptions", "Requests preempted for KV cache blocks.",
                                            labels=names), s["num_preemptions"])
        if s.get("spec"):   # chapter 10: speculative decoding
            spec = s["spec"]
            for name, doc in (("num_drafts", "Proposals verified."), ("num_draft_tokens", "Tokens proposed."),
                              ("num_accepted_tokens", "Proposed tokens accepted.")):
                yield self._one(CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=names),
                                spec[f"spec_decode_{name}"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens accepted, by position.", labels=names + ["position"])
            for position, count in enumerate(spec["spec_decode_num_accepted_tokens_per_pos"]):
                per_pos.add_metric(list(self.labels.values()) + [str(position)], count)
            yield per_pos


class ServerMetrics:
    def __init__(self, front, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(front, model_name))
        labels, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for finished requests.",
                                         labels, registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests finished, by why they finished.",
                                labels + ["finished_reason"], registry=reg)
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_REQUEST_BUCKETS, registry=reg).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                                    buckets=_REQUEST_BUCKETS, registry=reg).labels(model_name)

    def record(self, out) -> None:
        """Account one finished request (a RequestOutput with finished=True, or aborted midway)."""
        m = out.metrics
        tokens = out.outputs[0].token_ids
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(tokens))
        self._success.labels(self.model_name, out.outputs[0].finish_reason or "abort").inc()
        if m.get("ttft") is not None:
            self.ttft.observe(m["ttft"])
        if m.get("time_in_queue") is not None:
            self.queue_time.observe(m["time_in_queue"])
        if m.get("finished_time") is not None:
            self.e2e.observe(m["finished_time"] - m["arrival_time"])
        times = m.get("token_times") or []
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)

    def record_aborts(self, count: int) -> None:
        """Requests aborted before any output reached their handler (a client that left while they waited)."""
        self._success.labels(self.model_name, "abort").inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
