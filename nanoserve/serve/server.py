"""`python -m nanoserve serve`: load a model, start the engine loop, serve OpenAI's API with uvicorn.

    python -m nanoserve serve --port 8000 --max-num-seqs 32      # the course model on 127.0.0.1:8000

The flags are the engine's options with vLLM's spelling. The server binds loopback unless told otherwise
(`--host 0.0.0.0` exposes it; pair that with `--api-key`). On SIGINT or SIGTERM uvicorn stops accepting
connections and lets the requests in flight finish for up to `--shutdown-timeout` seconds. A second before
that deadline, what is still running or waiting is stopped (its KV blocks freed) and answered: a stream ends
with an error event and `[DONE]`, a non-streamed request gets a 503 with OpenAI's error JSON. Then the engine
loop stops and the process exits with 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from nanoserve.engine.args import EngineArgs


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanoserve serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients use in 'model' (default: 'course' for the course model, else the directory's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    EngineArgs.add_cli_args(ap)   # the engine's options: --model, --max-num-seqs, --dtype, ... (nanoserve/engine/args.py)
    ap.add_argument("--max-queued-requests", type=int, default=None,
                    help="requests waiting beyond the running batch before new ones get 429 (default: no bound)")
    ap.add_argument("--max-queued-prompt-tokens", type=int, default=None,
                    help="prompt tokens waiting before new requests get 429 (default: no bound)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed chunk after the first (vLLM's flag): fewer chunks, less host work per "
                         "token, burstier streams")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    ap.add_argument("--profile-dir", default=None,
                    help="enable POST /start_profile and /stop_profile (vLLM's routes), which write a torch.profiler "
                         "trace of the engine and the HTTP requests' spans here (nanoserve/serve/profiling.py)")
    ap.add_argument("--uvicorn-log-level", default="warning")
    return ap


def build(args):
    """The LLM, its engine front and the ASGI app for parsed `args` (raises ValueError on bad options)."""
    from pathlib import Path

    from nanoserve import LLM
    from nanoserve.engine.async_engine import AsyncLLMEngine
    from nanoserve.models.shipped import COURSE_MODEL
    from nanoserve.serve.app import build_app
    from nanoserve.serve.chat import ChatTemplate

    llm = LLM(**EngineArgs.from_cli_args(args).kwargs())
    path = COURSE_MODEL if args.model is None else args.model
    name = args.served_model_name or ("course" if args.model is None else Path(args.model).name)
    front = AsyncLLMEngine(llm.engine, args.max_queued_requests, args.max_queued_prompt_tokens, args.stream_interval)
    app = build_app(front, llm.tokenizer, ChatTemplate.for_model(path), name, llm.engine.config.max_model_len,
                    args.api_key)
    if args.profile_dir is not None:
        from nanoserve.serve.profiling import add_profiling
        add_profiling(app, front, args.profile_dir)
    return llm, front, app


def main(argv=None) -> None:
    import uvicorn
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        llm, front, app = build(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"nanoserve serve: {e}")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again against the handler it found installed.
    # Installing one that only notes it lets the engine loop stop and the process exit 0 after the drain.
    stopped_by = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopped_by.append(signal.Signals(signum).name))
    done = threading.Event()
    threading.Thread(target=stop_at_deadline, args=(server, front, args.shutdown_timeout, done), daemon=True).start()
    print(f"nanoserve: serving {app.state.server.model!r} on http://{args.host}:{args.port}/v1 "
          f"(max_num_seqs {args.max_num_seqs}, max_model_len {llm.engine.config.max_model_len})", flush=True)
    try:
        server.run()          # returns after SIGINT/SIGTERM, once in-flight requests drained or timed out
    finally:
        done.set()
        front.shutdown()
        llm.shutdown()
    print(f"nanoserve: stopped{' by ' + stopped_by[0] if stopped_by else ''}", flush=True)
    if not server.started:
        sys.exit(1)           # the port was taken, say: uvicorn has printed why


def stop_at_deadline(server, front, timeout_s: float, done: threading.Event, margin_s: float = 1.0) -> None:
    """Once uvicorn begins its graceful shutdown, wait until `margin_s` before its deadline; then stop every
    request still in flight, so each is answered while uvicorn still waits for it (past the deadline uvicorn
    cancels the handlers: streams cut off with no [DONE], and a traceback each in the log)."""
    while not server.should_exit:
        if done.wait(0.1):
            return
    if done.wait(max(0.0, timeout_s - margin_s)):
        return
    logging.getLogger("nanoserve.serve").warning("shutdown: %.0f s passed; stopping the requests still in flight",
                                                 timeout_s - margin_s)
    front.stop_all("the server is shutting down")
