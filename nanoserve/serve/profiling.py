"""Profiling a running server (chapter 11), with vLLM's routes: `POST /start_profile`, `POST /stop_profile`.

    python -m nanoserve serve --profile-dir traces/      # the routes exist only with a directory to write to

Between the two calls the engine's loop thread runs under torch.profiler (every `engine.step`, `model.forward`
and operator), and the event loop times every HTTP request from its arrival to the last byte of its answer and
counts its own CPU seconds. `/stop_profile` writes two files and answers with their paths:

    engine-<stamp>.json   the loop thread's Chrome trace (Perfetto opens it as it is)
    server-<stamp>.json   the window, both threads' CPU seconds, the HTTP requests' spans (perf_counter seconds)
                          and the clock anchor that puts the trace on the same clock

`nanoserve.perf.server_profile.load(answer)` joins them into one trace and a table of the stack's layers.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from fastapi import FastAPI, Request

from nanoserve.serve.protocol import APIError


class RequestSpans:
    """ASGI middleware: while `spans` is a list, each HTTP request's (start, end, path, status) goes into it."""

    def __init__(self, app, recorder: "ServerProfiler"):
        self.app, self.recorder = app, recorder

    async def __call__(self, scope, receive, send):
        spans = self.recorder.spans
        if scope["type"] != "http" or spans is None:
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), []

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            spans.append([start, time.perf_counter(), scope["path"], status[0] if status else None])


class ServerProfiler:
    def __init__(self, front, directory: str | Path):
        self.front, self.directory = front, Path(directory)
        self.spans: list | None = None       # a list while profiling
        self.loop_cpu = 0.0

    async def start(self) -> dict:
        if self.spans is not None:
            raise APIError(409, "a profile is already running: POST /stop_profile first")
        self.directory.mkdir(parents=True, exist_ok=True)
        await self.front.start_profile()
        self.spans, self.loop_cpu = [], time.thread_time()   # the handlers run on the event loop's thread
        return {"status": "profiling"}

    async def stop(self) -> dict:
        if self.spans is None:
            raise APIError(409, "no profile is running: POST /start_profile first")
        spans, self.spans = self.spans, None
        loop_cpu = time.thread_time() - self.loop_cpu
        stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{time.perf_counter_ns() % 10**6:06d}"
        engine = await self.front.stop_profile(str(self.directory / f"engine-{stamp}.json"))
        server_trace = self.directory / f"server-{stamp}.json"
        server_trace.write_text(json.dumps(dict(engine, event_loop_cpu_s=loop_cpu, requests=spans)))
        return {"engine_trace": engine["engine_trace"], "server_trace": str(server_trace)}


def add_profiling(app: FastAPI, front, directory: str | Path) -> ServerProfiler:
    """The two routes and the request timer, on `app`."""
    profiler = ServerProfiler(front, directory)
    app.add_middleware(RequestSpans, recorder=profiler)
    server = app.state.server

    @app.post("/start_profile")
    async def start_profile(request: Request):
        server.check_auth(request)
        return await profiler.start()

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        server.check_auth(request)
        return await profiler.stop()

    return profiler
