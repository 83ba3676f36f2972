"""The named peer of chapter 09: an OpenAI-compatible server as one writes it without an engine.

    python -m nanoserve.serve.naive --model DIR --port 8001 --served-model-name course

transformers' `generate` with a `TextIteratorStreamer`, one request at a time: requests queue on an asyncio
lock and each runs alone, start to finish, in a worker thread, while the event loop streams its text pieces
as server-sent events. It speaks what our server speaks (`/v1/completions`, streamed or not, with the
include_usage chunk; `/v1/models`; `/health`), so the same load client measures both, and its greedy text is
the offline engine's. What it lacks is the lesson: no batching, so every request waits for all those before
it, and the CPU (or GPU) does one sequence's worth of work per step however many are waiting.

The streamer hands out text a word at a time (it holds a token back until a space or newline), so a chunk
may carry a few tokens; the load client counts tokens from the usage chunk, so only TTFT and ITL see this.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, TextIteratorStreamer

from nanoserve.validation import FieldError, check_int, check_number


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body."""
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class StopWhenSet(StoppingCriteria):
    """Ends `generate` early once set: a client that left should not keep the next request waiting."""

    def __init__(self):
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


def build_app(model_dir: str, served_model_name: str) -> FastAPI:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    max_len = model.config.max_position_embeddings
    lock = asyncio.Lock()   # one request at a time; the others wait here, in arrival order
    app = FastAPI(title="naive transformers server")

    async def generate(ids: list[int], max_tokens: int, options: dict, usage: dict):
        """Yields the completion's text pieces; fills `usage` (token counts) at the end."""
        async with lock:
            streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
            stop, result = StopWhenSet(), {}

            def work():   # the worker thread: the whole generation, one token per forward
                try:
                    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         streamer=streamer, stopping_criteria=[stop], max_new_tokens=max_tokens,
                                         pad_token_id=tok.eos_token_id, **options)
                    result["n"] = out.shape[1] - len(ids)
                except Exception as e:   # the stream must still end, and the handler re-raise it
                    result["error"] = e
                    streamer.end()

            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            try:
                while (piece := await asyncio.to_thread(next, streamer, None)) is not None:
                    if piece:
                        yield piece
            finally:
                stop.event.set()
                with anyio.CancelScope(shield=True):   # hold the lock until the thread is done, even if cancelled
                    await anyio.to_thread.run_sync(thread.join)
            if "error" in result:
                raise result["error"]
            usage.update(prompt_tokens=len(ids), completion_tokens=result["n"], total_tokens=len(ids) + result["n"])

    def chunk(rid: str, created: int, text: str, finish_reason=None) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body)}\n\n"

    async def stream(rid, created, ids, max_tokens, options, include_usage):
        usage = {}
        async for piece in generate(ids, max_tokens, options, usage):
            yield chunk(rid, created, piece)
        yield chunk(rid, created, "", "length" if usage["completion_tokens"] == max_tokens else "stop")
        if include_usage:
            body = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                    "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "naive", "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        if body.get("model", served_model_name) != served_model_name:
            return error(404, f"model {body['model']!r} does not exist: this server serves {served_model_name!r}",
                         "model")
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens", 16)
        temperature = body.get("temperature", 1.0)
        if not isinstance(prompt, str):
            return error(400, "prompt must be a string", "prompt")
        try:
            check_int("max_tokens", max_tokens)
            check_number("temperature", temperature, minimum=0)
        except FieldError as e:
            return error(400, str(e), e.field)
        ids = tok(prompt).input_ids
        if not ids or len(ids) + max_tokens > max_len:
            return error(400, f"{len(ids)} prompt tokens + max_tokens {max_tokens} must be between 1 and the "
                              f"model's {max_len}", "max_tokens")
        options = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                      top_p=body.get("top_p", 1.0))
        if body.get("ignore_eos"):
            options["min_new_tokens"] = max_tokens   # generate cannot ignore EOS; forbidding it until the end can
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(rid, created, ids, max_tokens, options, include_usage),
                                     media_type="text/event-stream")
        usage = {}
        text = "".join([piece async for piece in generate(ids, max_tokens, options, usage)])
        finish = "length" if usage["completion_tokens"] == max_tokens else "stop"
        return {"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": usage}

    return app


def main(argv=None) -> None:
    import os

    import uvicorn

    from nanoserve import COURSE_MODEL
    ap = argparse.ArgumentParser(prog="python -m nanoserve.serve.naive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Hugging Face-format directory (default: the course model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--served-model-name", default=None,
                    help="the model id clients send (default: 'course' for the course model, else the directory's "
                         "name, as our server)")
    args = ap.parse_args(argv)
    default_name = "course" if args.model is None else os.path.basename(os.path.normpath(args.model))
    name = args.served_model_name or default_name
    uvicorn.run(build_app(args.model or COURSE_MODEL, name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
