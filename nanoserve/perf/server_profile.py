"""A running server's profile, across the stack (chapter 11): the files `POST /stop_profile` wrote, joined.

    answer = httpx.post(f"{url}/stop_profile").json()      # after /start_profile and some load
    prof = server_profile.load(answer)
    prof.layers()        # seconds of the window per layer: API, engine, model, kernels, idle
    prof.export_perfetto("capstone.json")                  # one trace: HTTP requests, steps, forwards, operators

The layers are the stack chapter 00 opened with, measured on the two threads a server runs:

    API      the event loop's thread: HTTP, JSON, tokenizing prompts, framing each chunk (its CPU seconds)
    engine   the loop thread inside `engine.step` but outside the forward: scheduling, sampling, detokenizing
    model    inside `model.forward` but outside any operator: the model's Python, building the step's tensors
    kernels  inside operators (aten's, and the C paged attention): the arithmetic and its dispatch
    idle     the loop thread outside any step: waiting for work, handing outputs to the event loop

engine + model + kernels + idle is the window's wall time; API ran beside them on another thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson   # a profile of a few seconds of serving is ~80 MB of JSON: orjson reads it in about half json's time

from nanoserve.engine.async_engine import CLOCK_SPAN
from nanoserve.engine.tracing import FORWARD_SPAN, STEP_SPAN
from nanoserve.perf.trace import KERNEL_PREFIX, flop_formula, op_flops

LAYERS = ("API", "engine", "model", "kernels", "idle")


@dataclass(frozen=True)
class Span:
    name: str
    start_s: float        # perf_counter seconds, the server's clock
    dur_s: float
    args: dict

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def _outermost(spans: list[Span]) -> list[Span]:
    """Spans not inside another of the list (operators call operators: count each moment once)."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.start_s, -s.dur_s)):
        if not out or s.start_s >= out[-1].end_s:
            out.append(s)
    return out


def _within(inner: list[Span], outer: list[Span]) -> list[Span]:
    """The spans of `inner` that start inside one of `outer` (both sorted by start)."""
    out, k = [], 0
    for s in inner:
        while k < len(outer) and outer[k].end_s <= s.start_s:
            k += 1
        if k < len(outer) and outer[k].start_s <= s.start_s:
            out.append(s)
    return out


class ServerProfile:
    def __init__(self, server: dict, trace: dict):
        self.window = tuple(server["window_s"])
        self.event_loop_cpu_s, self.engine_thread_cpu_s = server["event_loop_cpu_s"], server["engine_thread_cpu_s"]
        self.requests = [tuple(r) for r in server["requests"]]            # (start, end, path, status)
        events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
        anchors = [e for e in events if e.get("name") == CLOCK_SPAN]
        if not anchors:
            raise ValueError(f"the engine trace has no {CLOCK_SPAN!r} span: not a trace /stop_profile wrote")
        ts0, t0 = anchors[0]["ts"], server["clock_anchor_s"]
        tid = anchors[0]["tid"]
        self.raw = [e for e in events if e.get("tid") == tid]            # the loop thread's events
        self.spans = [Span(e["name"], t0 + (e["ts"] - ts0) / 1e6, e.get("dur", 0) / 1e6, e.get("args", {}))
                      for e in self.raw]
        self._ts0, self._t0 = ts0, t0
        named = lambda name: sorted((s for s in self.spans if s.name == name), key=lambda s: s.start_s)
        self.steps, self.forwards = named(STEP_SPAN), named(FORWARD_SPAN)
        ops = [s for e, s in zip(self.raw, self.spans)
               if e.get("cat") == "cpu_op" or s.name.startswith(KERNEL_PREFIX)]
        self._ops = _within(sorted(ops, key=lambda s: s.start_s), self.forwards)   # every depth
        self.kernels = _within(_outermost(ops), self.forwards)

    @property
    def wall_s(self) -> float:
        return self.window[1] - self.window[0]

    def layers(self) -> dict[str, float]:
        """Seconds of the window per layer (the module's docstring says what each holds)."""
        steps, forwards = sum(s.dur_s for s in self.steps), sum(s.dur_s for s in self.forwards)
        kernels = sum(s.dur_s for s in self.kernels)
        return {"API": self.event_loop_cpu_s, "engine": steps - forwards, "model": forwards - kernels,
                "kernels": kernels, "idle": max(0.0, self.wall_s - steps)}

    def kernel_flops(self) -> float:
        """FLOPs of the operators inside the forwards, from their recorded shapes. Every depth is summed: the ops
        that do arithmetic (mm, addmm, bmm) have formulas, those that call them (linear, matmul) count 0."""
        def flat(dims):   # a list of tensors (aten::cat's input) has no formula here: left out
            return [d if all(isinstance(n, int) for n in d) else [] for d in dims]
        return sum(op_flops(s.name, flat(s.args.get("Input Dims", []))) for s in self._ops if flop_formula(s.name))

    def step_shapes(self) -> list[dict]:
        """Per forward: the tokens it carried (prompt chunks and decodes), the sequences it sampled for, and its
        seconds, read from its operators' recorded shapes: the embedding's input is [1, tokens], and the head is
        the linear whose weight has the embedding's rows (the vocabulary)."""
        out, ops, k = [], self._ops, 0
        for f in self.forwards:
            while k < len(ops) and ops[k].start_s < f.start_s:
                k += 1
            inside = []
            while k < len(ops) and ops[k].start_s < f.end_s:
                inside.append(ops[k])
                k += 1
            embedding = next((o for o in inside if o.name == "aten::embedding"), None)
            if embedding is None:           # a compiled forward records no eager embedding: shapes unknown
                continue
            vocab, tokens = embedding.args["Input Dims"][0][0], embedding.args["Input Dims"][1][-1]
            heads = [o.args["Input Dims"][0][0] for o in inside if o.name == "aten::linear"
                     and len(o.args["Input Dims"]) > 1 and o.args["Input Dims"][1][:1] == [vocab]]
            out.append(dict(tokens=tokens, seqs=heads[-1] if heads else 0, forward_s=f.dur_s))
        return out

    def export_perfetto(self, path: str | Path) -> str:
        """One Chrome/Perfetto trace: the HTTP requests (one lane per request in flight at once) above the
        engine's loop thread (steps, forwards, operators), on the server's clock from the window's start."""
        us = lambda t: (t - self.window[0]) * 1e6
        events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "HTTP requests (event loop)"}},
                  {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "engine loop thread"}}]
        lanes: list[float] = []                               # each lane's end: a request takes the first free one
        for start, end, route, status in sorted(self.requests):
            lane = next((k for k, free in enumerate(lanes) if free <= start), len(lanes))
            lanes[lane:lane + 1] = [end]
            events.append({"ph": "X", "pid": 1, "tid": lane, "name": f"{route} {status}", "ts": us(start),
                           "dur": (end - start) * 1e6})
        for e, s in zip(self.raw, self.spans):
            events.append({"ph": "X", "pid": 2, "tid": 0, "name": s.name, "cat": e.get("cat", ""),
                           "ts": us(s.start_s), "dur": s.dur_s * 1e6, "args": s.args})
        Path(path).write_bytes(orjson.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return str(path)


def load(answer: dict) -> ServerProfile:
    """The profile from /stop_profile's answer ({"engine_trace": path, "server_trace": path})."""
    try:
        server = orjson.loads(Path(answer["server_trace"]).read_bytes())
        trace = orjson.loads(Path(answer["engine_trace"]).read_bytes())
    except KeyError as e:
        raise ValueError(f"expected /stop_profile's answer with engine_trace and server_trace, not {answer!r}") from e
    return ServerProfile(server, trace)
