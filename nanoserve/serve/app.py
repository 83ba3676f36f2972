"""The HTTP front: OpenAI's routes over an AsyncLLMEngine, on FastAPI (Starlette) served by uvicorn.

    app = build_app(front, tokenizer, chat_template, served_model_name="course", max_model_len=1024)

Each request is handled on the event loop: parse and check the body (a 400 names the field), tokenize the
prompt (so a prompt too long for the model is a 400 and the queue bound can count tokens), submit it to the
engine loop, and relay what comes back, as one JSON response or as server-sent events. The engine loop
runs on its own thread (`AsyncLLMEngine`); the event loop never waits on a step, so new requests are taken
while a batch runs, and join it at the next step.

What a server must survive, and how this one does:
  - a bad request: OpenAI's error JSON with a 4xx; an exception nobody expected is still answered (500,
    the same JSON) and the server goes on;
  - a full queue: 429 with Retry-After, before anything is queued;
  - a client that leaves mid-stream: Starlette cancels the response, and leaving `front.generate` aborts
    the request, freeing its KV blocks at the next step boundary; one that leaves before its first token, or
    while a non-streamed answer is computed, is noticed within `DISCONNECT_POLL_S` (`unless_gone`) and its
    request aborted the same way, queued or running: it is never admitted or prefilled for nobody;
  - an engine error in one request's step: that request ends with the error (a 500, or an error event in
    its stream), the others go on.
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanoserve.engine.async_engine import EngineStopping, QueueFull
from nanoserve.serve import protocol
from nanoserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from nanoserve.serve.protocol import APIError
from nanoserve.validation import is_int

log = logging.getLogger("nanoserve.serve")
RETRY_AFTER_S = 1   # what a 429 tells the client to wait: about one batch's worth of decode steps here
DISCONNECT_POLL_S = 0.1   # how often a handler that waits on the engine checks that its client is still there


class ClientGone(Exception):
    """The client disconnected while its handler waited on the engine: its requests were aborted."""

    def __init__(self, requests: int = 1):
        super().__init__(f"the client left; {requests} request(s) aborted")
        self.requests = requests


async def unless_gone(request: Request | None, awaitable):
    """Await `awaitable`, unless the client disconnects first: then cancel it (leaving `front.generate` aborts
    the request) and raise ClientGone. Starlette cancels a handler only once a streamed response has begun."""
    task = asyncio.ensure_future(awaitable)
    try:
        while request is not None:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                raise ClientGone
        return await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})   # its generators' cleanup (the abort) has run


class Server:
    """The state the routes share: the engine front, the tokenizer, the limits, the metrics."""

    def __init__(self, front, tokenizer, chat_template, served_model_name: str, max_model_len: int,
                 api_key: str | None = None):
        self.front, self.tokenizer, self.chat_template = front, tokenizer, chat_template
        self.model, self.max_model_len, self.api_key = served_model_name, max_model_len, api_key
        self.metrics = ServerMetrics(front, served_model_name)

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type_="AuthenticationError")

    def tokenize(self, prompt, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise protocol.bad(param, f"token ids must be in [0, {vocab}); got {bad[:3]}")
        if not ids:
            raise protocol.bad(param, "is empty after tokenization")
        return ids

    def check_length(self, ids: list[int], params, param: str) -> None:
        """OpenAI's answer to a request that cannot fit: a 400 that gives the numbers."""
        if len(ids) >= self.max_model_len:
            raise protocol.bad(param, f"has {len(ids)} tokens; this model's maximum context length is "
                                      f"{self.max_model_len} tokens (prompt plus at least one new token)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                                f"{params.max_tokens} for the completion).", "max_tokens")

    async def start(self, prompts: list[list[int]], params, kind: str, request: Request | None = None) -> list:
        """Submit one engine request per choice, each prompt sampled params.n times (choice index = prompt index x n
        + sample), all at once so they share each step; return [(request id, first output, iterator of the rest)].
        If one is refused, the others are aborted: QueueFull → 429, shutting down → 503, a bad request → 400;
        a client that leaves before the first outputs → ClientGone."""
        samples = [params.child(j) for j in range(params.n)] if params.n > 1 else [params]
        choices = [(prompt, sample) for prompt in prompts for sample in samples]
        ids = [protocol.new_id(kind) for _ in choices]
        streams = [self.front.generate(i, prompt, sample) for i, (prompt, sample) in zip(ids, choices)]
        firsts = None
        try:
            firsts = await unless_gone(request, asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True))
        except ClientGone:
            raise ClientGone(len(streams)) from None
        finally:
            refused = [f for f in firsts or [] if isinstance(f, BaseException)]
            if firsts is None or refused:
                for stream in streams:                  # a no-op for a refused one; aborts the others
                    await stream.aclose()
        if refused:
            raise engine_refusal(refused[0])
        return list(zip(ids, firsts, streams))


def engine_refusal(e: BaseException) -> BaseException:
    """The HTTP answer to a request the engine would not take (or the error itself, if it is none of these)."""
    if isinstance(e, QueueFull):
        return APIError(429, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineStopping):             # still queued when the server's shutdown deadline came
        return APIError(503, str(e))
    if isinstance(e, (ValueError, TypeError)):
        return APIError(400, str(e))
    return e


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def build_app(front, tokenizer, chat_template, served_model_name: str, max_model_len: int,
              api_key: str | None = None) -> FastAPI:
    server = Server(front, tokenizer, chat_template, served_model_name, max_model_len, api_key)
    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server over the nanoserve engine (chapter 09).")
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):   # nobody reads it: nginx's "client closed request"
        server.metrics.record_aborts(e.requests)
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def route_error(request: Request, e: HTTPException):   # no such route (404), wrong method (405)
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = APIError(e.status_code, what.get(e.status_code, str(e.detail)),
                         type_={404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code))
        return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):   # a bug of ours: still an answer, and still serving
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": protocol.now(), "owned_by": "nanoserve",
                "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")   # the openai client's models.retrieve
    async def model(model_id: str, request: Request):
        server.check_auth(request)
        protocol.check_model({"model": model_id}, served_model_name)
        return model_card()

    @app.get("/version")
    async def version():
        from nanoserve import __version__
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])   # vLLM's (SageMaker's) liveness route, as /health
    async def ping():
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.check_auth(request)
        body = protocol.parse_json(await request.body())
        protocol.check_model(body, served_model_name)
        if "messages" in body:
            text = chat_template.render(protocol.chat_messages(body))
            ids = server.tokenize(text, "messages", add_special_tokens=False)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise protocol.bad("prompt", "expected a non-empty string")
            ids = server.tokenize(prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server.check_auth(request)
        body = protocol.parse_json(await request.body())
        protocol.check_model(body, served_model_name)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise protocol.bad("tokens", "expected a list of token ids")
        server.tokenize(tokens, "tokens") if tokens else None
        return {"prompt": tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.check_auth(request)
        req = protocol.completion_request(protocol.parse_json(await request.body()), served_model_name)
        batch = req.prompts or [req.prompt]
        names = ["prompt"] if len(batch) == 1 else [f"prompt[{i}]" for i in range(len(batch))]
        prompts = [server.tokenize(p, name) for p, name in zip(batch, names)]
        for ids, name in zip(prompts, names):
            server.check_length(ids, req.params, name)
        return await respond(server, prompts, req, "cmpl", protocol.completion_chunk, "text_completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        server.check_auth(request)
        body = protocol.parse_json(await request.body())
        model = protocol.check_model(body, served_model_name)
        text = chat_template.render(protocol.chat_messages(body))
        ids = server.tokenize(text, "messages", add_special_tokens=False)
        # no max_tokens: the rest of the context, as vLLM answers a chat
        params, stream, include_usage = protocol.sampling_params(body, "max_completion_tokens", chat=True,
                                                                 default_max_tokens=max(1, max_model_len - len(ids)))
        server.check_length(ids, params, "messages")
        req = protocol.check_choices(protocol.ParsedRequest(text, params, stream, include_usage, model,
                                                            continuous_usage=protocol.continuous_usage(body)))
        return await respond(server, [ids], req, "chatcmpl", protocol.chat_chunk, "chat.completion.chunk", request)

    return app


async def respond(server: Server, prompts: list[list[int]], req, kind: str, make_chunk, chunk_object: str,
                  request: Request | None = None):
    """Answer a completions or chat request: every choice (each prompt of a batch, each sampled n times) is an
    engine request of its own, and they run together, sharing each prompt's KV blocks through the prefix cache.
    Streamed, each chunk carries one choice's new text under its index, as OpenAI interleaves them; if one choice
    fails or the client leaves, the others are aborted."""
    runs = await server.start(prompts, req.params, kind, request)
    request_id, created, chat, n = runs[0][0], protocol.now(), kind == "chatcmpl", req.params.n
    batch = req.prompts or [req.prompt]
    ids_of = [prompts[k // n] for k in range(len(runs))]         # choice k's prompt tokens

    def usage(finals) -> dict:   # each prompt counted once; its cached tokens as its first sample found them
        return protocol.usage(sum(map(len, prompts)), sum(len(o.outputs[0].token_ids) for o in finals),
                              sum(o.num_cached_tokens for o in finals[::n]))

    if not req.stream:
        try:
            finals = await unless_gone(request, asyncio.gather(*(last_of(first, rest) for _, first, rest in runs)))
        except ClientGone:
            raise ClientGone(len(runs)) from None
        except RuntimeError as e:                    # the engine failed one of them, or is stopping
            raise APIError(503 if isinstance(e, EngineStopping) else 500, str(e)) from None
        finally:
            for _, _, rest in runs:                  # a no-op for those that finished; aborts the others
                await rest.aclose()
        for out in finals:
            server.metrics.record(out)
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": req.model, "usage": usage(finals),
                "choices": [choice(server, req, ids_of[k], out, k, chat, batch[k // n]) for k, out in enumerate(finals)]}

    lasts = [first for _, first, _ in runs]          # each choice's latest output (for usage and the metrics)

    def chunk(k: int, payload, reason: str | None, scored: dict | None = None, tokens: int = 0) -> bytes:
        framed = make_chunk(request_id, req.model, created, payload, reason, req.include_usage)
        framed["choices"][0].update(index=k, logprobs=scored)
        if req.continuous_usage:                     # choice k's usage so far (its `tokens` generated)
            framed["usage"] = protocol.usage(len(ids_of[k]), tokens, runs[k][1].num_cached_tokens)
        return protocol.sse(framed)

    async def choice_events(k: int):
        """Choice k's chunks: its opening (the chat role, or the echoed prompt), then its text as it comes."""
        ids, out, rest = ids_of[k], runs[k][1], runs[k][2]
        echo = echoed(server, batch[k // n], ids) if req.echo else ""
        sent_tokens, sent_chars = 0, len(echo)       # what earlier chunks carried (logprobs, text offsets)
        if chat:
            yield chunk(k, {"role": "assistant", "content": ""}, None)
        elif echo:
            yield chunk(k, echo, None, scored_tokens(server, req, ids, out, 0, 0, 0, chat, with_prompt=True))
        while True:
            completion = out.outputs[0]
            reason = _finish_reason(completion.finish_reason) if out.finished else None
            if completion.text_delta or reason is not None:
                count = len(completion.token_ids)
                yield chunk(k, {"content": completion.text_delta} if chat else completion.text_delta, reason,
                            scored_tokens(server, req, ids, out, sent_tokens, count, sent_chars, chat), count)
                sent_tokens, sent_chars = count, sent_chars + len(completion.text_delta)
            lasts[k] = out
            if out.finished:
                return
            try:
                out = await rest.__anext__()
            except StopAsyncIteration:               # ended unfinished (aborted): nothing more to send
                return

    async def events():
        try:
            async for event in merged([choice_events(k) for k in range(len(runs))]):
                yield event
            if req.include_usage:
                yield protocol.sse(protocol.usage_chunk(request_id, chunk_object, req.model, created, usage(lasts)))
        except RuntimeError as e:                    # the engine failed a choice, or is stopping: say so
            yield protocol.sse(APIError(503 if isinstance(e, EngineStopping) else 500, str(e)).body())
        finally:
            for _, _, rest in runs:                  # a disconnect (cancelled) or an error: abort, free blocks
                await rest.aclose()
            for out in lasts:
                server.metrics.record(out)
        yield protocol.sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def merged(streams: list):
    """The items of several async generators as each comes; those ready together in list order. Leaving early
    (cancelled, or an error in one) closes them all."""
    pending = {k: asyncio.ensure_future(stream.__anext__()) for k, stream in enumerate(streams)}
    try:
        while pending:
            await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
            for k in [k for k, task in pending.items() if task.done()]:
                try:
                    item = pending.pop(k).result()
                except StopAsyncIteration:
                    continue
                yield item
                pending[k] = asyncio.ensure_future(streams[k].__anext__())
    finally:
        for task in pending.values():
            task.cancel()
        await asyncio.gather(*pending.values(), return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def echoed(server: Server, prompt, ids: list[int]) -> str:
    """The prompt as `echo` returns it: the text sent, or the token ids decoded."""
    return prompt if isinstance(prompt, str) else server.tokenizer.decode(ids)


def scored_tokens(server: Server, req, ids: list[int], out, start: int, stop: int, offset: int, chat: bool,
                  with_prompt: bool = False) -> dict | None:
    """The logprobs of generated tokens [start, stop) (and first the prompt's, with echo), as OpenAI frames them."""
    if req.params.logprobs is None:
        return None
    tokens, entries = out.outputs[0].token_ids[start:stop], out.outputs[0].logprobs[start:stop]
    if chat:
        return protocol.chat_logprobs(server.tokenizer.decode, tokens, entries, req.params.logprobs)
    if with_prompt:
        tokens, entries = ids + tokens, out.prompt_logprobs + entries
    return protocol.completion_logprobs(server.tokenizer.decode, tokens, entries, offset)


def choice(server: Server, req, ids: list[int], out, index: int, chat: bool, prompt=None) -> dict:
    """One choice of a non-streamed answer: the completion (after the prompt, with echo), its logprobs, why it ended."""
    completion = out.outputs[0]
    reason = _finish_reason(completion.finish_reason)
    scored = scored_tokens(server, req, ids, out, 0, len(completion.token_ids), 0, chat, with_prompt=req.echo)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": completion.text}, "logprobs": scored,
                "finish_reason": reason}
    echo = echoed(server, req.prompt if prompt is None else prompt, ids) if req.echo else ""
    return {"index": index, "text": echo + completion.text, "logprobs": scored, "finish_reason": reason}


async def last_of(first, outputs):
    """The last of a request's outputs (the finished one), given its first and the iterator of the rest."""
    last = first
    async for last in outputs:
        pass
    return last
