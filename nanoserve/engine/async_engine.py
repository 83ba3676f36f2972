"""The engine behind a server (chapter 09): its loop on a thread of its own, requests joining a running batch.

    front = AsyncLLMEngine(engine, max_queued_requests=64)
    async for out in front.generate("req-1", "def f(x):", SamplingParams(max_tokens=32)):
        print(out.outputs[0].text_delta, end="")          # one RequestOutput per step the request advanced

`LLMEngine` is not thread-safe, so exactly one thread touches it: the loop thread. It takes commands (add a
request, abort one) from a queue between steps, runs `step()` while anything is unfinished, and hands each
output to its request's asyncio queue through the event loop (`call_soon_threadsafe`). The event loop only
waits; tokenization of the prompt, scheduling, the forward and detokenization all run on the loop thread,
between steps, which is where a server's "data pipeline" sits (chapter 09 measures it).

With `stream_interval` N (vLLM's `--stream-interval`), a request's outputs are handed over when it finishes, with
its first token, and then every N tokens, their text joined: a stream's per-token host work (handing the output
to the event loop, framing a chunk, the client's parsing) is paid once per N tokens (lab 09 measures it).

Leaving the `async for` early (a client that disconnected, a cancelled task) aborts the request: its KV
blocks are freed at the next step boundary. A bounded waiting queue (requests, and prompt tokens) refuses new
requests with `QueueFull` (a server answers 429) instead of letting latency grow without limit. A step that raises fails the requests
of that step, each with the error, and the loop goes on serving the others.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator

from nanoserve.outputs import RequestOutput
from nanoserve.validation import check_int

CLOCK_SPAN = "nanoserve.clock"   # a span at the start of a profile whose perf_counter time is recorded
_IDLE_WAIT_S = 0.05   # how long the idle loop blocks on the command queue before checking for shutdown


class EngineStopping(RuntimeError):
    """The engine stopped this request before it finished (the server is shutting down)."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (HTTP 429)."""


class AsyncLLMEngine:
    def __init__(self, engine, max_queued_requests: int | None = None, max_queued_prompt_tokens: int | None = None,
                 stream_interval: int = 1):
        for name, bound in (("max_queued_requests", max_queued_requests),
                            ("max_queued_prompt_tokens", max_queued_prompt_tokens)):
            check_int(name, bound, minimum=0, none_ok=True)
        check_int("stream_interval", stream_interval, minimum=1)
        self.stream_interval = stream_interval
        self._held: dict[str, tuple[int, str]] = {}   # loop thread only: tokens when last handed over, text since
        self.engine, self.max_queued_requests = engine, max_queued_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}   # loop thread only
        self._submitted = 0            # adds sent and not yet in a published snapshot (event-loop side)
        self._submitted_tokens = 0     # their prompt tokens, when known
        self.snapshot = self._take_snapshot()   # the engine's state, published by the loop thread (read anywhere)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._profile = None           # (profiler, clock anchor, start, thread CPU at start) while profiling
        self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)
        self._thread.start()

    # --- the event loop's side ------------------------------------------------------------------------

    def num_waiting(self) -> int:
        """Requests that would have to wait for a free place in the batch: those queued beyond what the
        running batch (max_num_seqs) has room for (read from another thread: a snapshot)."""
        with self._lock:
            pending, snap = self._submitted, self.snapshot
        return max(0, pending + snap["num_waiting"] + snap["num_running"] - snap["max_num_seqs"])

    def num_in_flight(self) -> int:
        """Requests submitted that no published snapshot counts yet (the loop thread has not taken them, or has
        and not yet published)."""
        with self._lock:
            return self._submitted

    def num_waiting_prompt_tokens(self) -> int:
        """Prompt tokens of the requests not yet admitted (the last published snapshot plus those in flight)."""
        with self._lock:
            return self._submitted_tokens + self.snapshot["waiting_prompt_tokens"]

    async def generate(self, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its RequestOutput each step it advances, the last with finished=True.
        `prompt`: text, or token ids (a server tokenizes first, so it can bound the queued prompt tokens).
        Raises QueueFull when the waiting queue is at its bound, ValueError/TypeError for a bad request."""
        if self._stop.is_set():
            raise RuntimeError("the engine has shut down")
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise QueueFull(f"{self.num_waiting()} requests are waiting (max_queued_requests = "
                            f"{self.max_queued_requests}); retry later")
        tokens = len(prompt) if isinstance(prompt, (list, tuple)) else 0
        waiting_tokens = self.num_waiting_prompt_tokens()   # a request that finds none waiting is always taken
        if (self.max_queued_prompt_tokens is not None and waiting_tokens
                and waiting_tokens + tokens > self.max_queued_prompt_tokens):
            raise QueueFull(f"{waiting_tokens} prompt tokens are waiting and this request brings "
                            f"{tokens} (max_queued_prompt_tokens = {self.max_queued_prompt_tokens}); retry later")
        sink: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._submitted += 1
            self._submitted_tokens += tokens
        self._commands.put(("add", request_id, prompt, params, asyncio.get_running_loop(), sink, tokens))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:   # the consumer left early: free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stop_all(self, reason: str) -> None:
        """Abort every request, waiting or running, and end each one's `generate` with EngineStopping(reason)
        (a server at its shutdown deadline answers them all instead of leaving them cut off)."""
        self._commands.put(("stop_all", reason))

    async def start_profile(self) -> None:
        """Start torch.profiler on the loop thread, where the engine's work runs (a profiler records the thread
        that starts it): every step, forward and operator from now until `stop_profile`."""
        await self._call("profile_start")

    async def stop_profile(self, path: str) -> dict:
        """Stop the profile and write its Chrome trace to `path`. Returns the trace's path, the perf_counter
        window it covers, the loop thread's CPU seconds in it, and the clock anchor: the perf_counter time of
        the trace's CLOCK_SPAN, which puts the trace on the same clock as spans timed elsewhere."""
        return await self._call("profile_stop", path)

    async def _call(self, *command):
        """Run one of the loop thread's own methods there, between steps, and await its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", command, loop, done))
        return await done

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread: requests still running are aborted."""
        self._stop.set()
        self._thread.join(timeout_s)

    # --- the loop thread ---------------------------------------------------------------------------------

    def _take_snapshot(self) -> dict:
        """What /metrics and admission read from other threads: plain numbers from `engine.metrics()`,
        replaced whole each time."""
        m = self.engine.metrics()
        spec = {k: v for k, v in m.items() if k.startswith("spec_decode_")}
        total = m["kv_blocks_total"]
        return dict(num_running=m["num_running"], num_waiting=m["num_waiting"], max_num_seqs=m["max_num_seqs"],
                    waiting_prompt_tokens=m["waiting_prompt_tokens"],
                    kv_cache_usage=1.0 - m["kv_blocks_free"] / total if total else 0.0,
                    prefix_cache_queries=m["prefix_cache_queried_tokens"],
                    prefix_cache_hits=m["prefix_cache_hit_tokens"],
                    num_preemptions=m["num_preemptions"], spec=spec or None)

    def _publish(self, taken: tuple[int, int] = (0, 0)) -> None:
        """Publish a new snapshot; the requests taken from the queue since the last one (count, prompt tokens)
        leave the in-flight count at the same moment, so admission never counts a request twice or not at all."""
        snap = self._take_snapshot()
        with self._lock:
            self.snapshot = snap
            self._submitted -= taken[0]
            self._submitted_tokens -= taken[1]

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._publish(self._drain_commands(block=not self.engine.has_unfinished()))
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:   # the step's requests fail, each with the error; the loop goes on
                self._fail_running(e)
                continue
            finally:
                self._publish()
            for out in outputs:
                if self._due(out):
                    self._send(out.request_id, out)
                if out.finished:
                    self._sinks.pop(out.request_id, None)
                    self._held.pop(out.request_id, None)
        for request_id in list(self._sinks):
            self.engine.abort(request_id)
            self._send(request_id, RuntimeError("the engine shut down"))
        if self._profile is not None:   # never stopped: the profiler leaves with the thread
            self._profile[0].__exit__(None, None, None)
        self._publish()

    def _drain_commands(self, block: bool) -> tuple[int, int]:
        """Apply every queued command; (requests taken, their prompt tokens)."""
        taken = [0, 0]
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0, 0
        while True:
            if command[0] == "add":
                taken[0], taken[1] = taken[0] + 1, taken[1] + command[-1]
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return taken[0], taken[1]

    def _apply(self, command) -> None:
        if command[0] == "call":
            _, (name, *args), loop, done = command
            try:
                outcome, result = "set_result", getattr(self, f"_{name}")(*args)
            except Exception as e:   # a profile already running, a path that cannot be written: the caller's error
                outcome, result = "set_exception", e
            loop.call_soon_threadsafe(lambda: done.done() or getattr(done, outcome)(result))
            return
        if command[0] == "stop_all":
            for request_id in list(self._sinks):
                self.engine.abort(request_id)
                self._send(request_id, EngineStopping(command[1]))
                self._sinks.pop(request_id, None)
            return
        if command[0] == "abort":
            request_id = command[1]
            self.engine.abort(request_id)
            self._sinks.pop(request_id, None)
            self._held.pop(request_id, None)
            return
        _, request_id, prompt, params, loop, sink, _ = command
        try:
            if request_id in self._sinks:
                raise ValueError(f"request_id {request_id!r} is already running or waiting")
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:   # a bad request fails alone, at its own await
            loop.call_soon_threadsafe(sink.put_nowait, e)
            return
        self._sinks[request_id] = (loop, sink)

    def _profile_start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
        if self._profile is not None:
            raise RuntimeError("a profile is already running: stop it first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=activities, record_shapes=True)
        prof.__enter__()
        with record_function(CLOCK_SPAN):
            anchor = time.perf_counter()
        self._profile = (prof, anchor, time.perf_counter(), time.thread_time())

    def _profile_stop(self, path: str) -> dict:
        if self._profile is None:
            raise RuntimeError("no profile is running: start one first")
        (prof, anchor, start, cpu), self._profile = self._profile, None
        end, cpu = time.perf_counter(), time.thread_time() - cpu
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(path)
        return dict(engine_trace=str(path), clock_anchor_s=anchor, window_s=[start, end], engine_thread_cpu_s=cpu,
                    engine_thread=threading.get_native_id())

    def _due(self, out: RequestOutput) -> bool:
        """Whether `out` is handed over now (stream_interval); a held output's text joins the next one's delta."""
        if self.stream_interval == 1:
            return True
        completion = out.outputs[0]
        sent, held = self._held.get(out.request_id, (0, ""))
        tokens = len(completion.token_ids)
        if out.finished or sent == 0 or tokens - sent >= self.stream_interval:
            completion.text_delta = held + completion.text_delta
            self._held[out.request_id] = (tokens, "")
            return True
        self._held[out.request_id] = (sent, held + completion.text_delta)
        return False

    def _send(self, request_id: str, item) -> None:
        target = self._sinks.get(request_id)
        if target is None:
            return
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:   # the client's event loop is closed: nobody is listening
            self.engine.abort(request_id)
            self._sinks.pop(request_id, None)

    def _fail_running(self, error: Exception) -> None:
        ids = self.engine.running_request_ids()
        self.engine.abort(ids)
        for request_id in ids:
            self._send(request_id, RuntimeError(f"request {request_id} failed in the engine: "
                                                f"{type(error).__name__}: {error}"))
            self._sinks.pop(request_id, None)

