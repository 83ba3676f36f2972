"""The OpenAI request and response shapes the server speaks, and the checks that turn a bad request into a 400.

A request body is read field by field: each known field has one expected type, and a wrong one is a 400
whose message names the field (`param`), as OpenAI's API answers. Unknown fields are ignored, as vLLM does
(clients send fields like `user` that change nothing here). Fields the engine does not implement are
accepted only at their neutral value (`best_of=1`, `suffix=null`, ...); anything else
is a 400 that says so, rather than a response that silently ignored what was asked. So is a number that is not
finite (JSON's 1e999 parses as infinity).

Responses follow OpenAI's framing: `text_completion` / `chat.completion` objects, and for a stream
`text_completion` / `chat.completion.chunk` chunks sent as server-sent events (`sse`). With vLLM's
`stream_options.continuous_usage_stats` (guidellm always sends it), every chunk carries its choice's usage so far.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from nanoserve.sampling import SamplingParams
from nanoserve.validation import FieldError, is_int


class APIError(Exception):
    """An error answered with OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.type = type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
                              429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


MAX_CHOICES = 128   # prompts x n in one request: each is a request of its own in the engine

# field -> (accepted JSON types, description for the error message)
_NUMBER = ((int, float), "a number")
_INT = ((int,), "an integer")
_BOOL = ((bool,), "true or false")
_SAMPLING_FIELDS = {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "seed": _INT, "max_tokens": _INT,
    "ignore_eos": _BOOL, "stream": _BOOL, "n": _INT,
    "stop": ((str, list), "a string or a list of strings"),
    "stream_options": ((dict,), "an object"),
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "stop_token_ids": ((list,), "a list of token ids"),
    "logprobs": _INT, "top_logprobs": _INT, "echo": _BOOL,   # chat's logprobs is a bool: read apart
    "min_p": _NUMBER, "min_tokens": _INT, "logit_bias": ((dict,), "an object of token id -> bias"),
}
_NEUTRAL = {"best_of": 1, "suffix": None, "tools": None, "include_stop_str_in_output": False,
            "response_format": {"type": "text"}}


def _field(body: dict, name: str, default=None):
    """body[name] when present and not null, checked against its expected JSON type."""
    value = body.get(name)
    if value is None:
        return default
    types, expected = _SAMPLING_FIELDS[name]
    # JSON true/false are Python bools, which are ints too: a bool is only a bool here
    if isinstance(value, bool) != (types == (bool,)) or not isinstance(value, types):
        raise bad(name, f"expected {expected}, got {json.dumps(value)[:40]}")
    if isinstance(value, float) and not math.isfinite(value):   # JSON's 1e999 parses as inf
        raise bad(name, f"expected a finite number, got {value}")
    return value


@dataclass
class ParsedRequest:
    prompt: str | list[int]          # text, or token ids (completions accept both); the first of `prompts`
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    echo: bool = False               # completions: the prompt comes back before the completion
    prompts: list | None = None      # completions: a batch of prompts, one choice each (times n)
    continuous_usage: bool = False   # stream_options.continuous_usage_stats: usage on every chunk

    @property
    def num_choices(self) -> int:
        return len(self.prompts or [self.prompt]) * self.params.n


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        return served                        # vLLM serves the one model when none is named
    if not isinstance(model, str):
        raise bad("model", f"expected a string, got {json.dumps(model)[:40]}")
    if model != served:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served!r}", "model",
                       "NotFoundError")
    return model


def logprobs_fields(body: dict, chat: bool) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for SamplingParams. Completions: `logprobs` is the top-k count, and with
    `echo` the prompt is scored too. Chat: `logprobs` is true or false, `top_logprobs` the count."""
    if not chat:
        k = _field(body, "logprobs")
        return k, (k if _field(body, "echo", False) else None)
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise bad("logprobs", f"expected true or false, got {json.dumps(want)[:40]}")
    top = _field(body, "top_logprobs")
    if top is not None and not want:
        raise bad("top_logprobs", "only allowed when logprobs is true")
    return ((top or 0) if want else None), None


def sampling_params(body: dict, max_tokens_field: str = "max_tokens", chat: bool = False,
                    default_max_tokens: int = 16) -> tuple[SamplingParams, bool, bool]:
    """The request's SamplingParams, whether it streams, and whether the stream ends with a usage chunk.
    Without max_tokens: OpenAI's 16 for a completion; a chat passes the rest of the context."""
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise bad(name, f"{json.dumps(value)[:40]} is not supported by this server (only {json.dumps(neutral)})")
    stream = _field(body, "stream", False)
    options = _field(body, "stream_options")
    if options is not None and not stream:
        raise bad("stream_options", "only allowed when stream is true")
    include_usage = False
    if options is not None:
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("stream_options.include_usage", f"expected true or false, got {json.dumps(include_usage)[:40]}")
        continuous = options.get("continuous_usage_stats", False)
        if not isinstance(continuous, bool):
            raise bad("stream_options.continuous_usage_stats", f"expected true or false, got {json.dumps(continuous)[:40]}")
    max_tokens = body.get(max_tokens_field)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = body.get("max_tokens")   # chat: max_completion_tokens, or the older max_tokens
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise bad(max_tokens_field, f"expected an integer, got {json.dumps(max_tokens)[:40]}")
    stop = _field(body, "stop")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise bad("stop", "expected a string or a list of strings")
    logprobs, prompt_logprobs = logprobs_fields(body, chat)
    bias = _field(body, "logit_bias")
    if bias is not None:   # JSON keys are strings: "50256": -100
        try:
            bias = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise bad("logit_bias", "expected an object whose keys are token ids") from None
    if chat and body.get("echo") not in (None, False):
        raise bad("echo", "is not supported for chat completions by this server (only false)")
    kwargs = dict(logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias, n=_field(body, "n", 1),
                  **{name: _field(body, name, default) for name, default in (
                      ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                      ("min_p", 0.0), ("min_tokens", 0))},
                  temperature=_field(body, "temperature", 1.0), top_p=_field(body, "top_p", 1.0),
                  top_k=_field(body, "top_k", -1), max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                  ignore_eos=_field(body, "ignore_eos", False), seed=_field(body, "seed"), stop=stop or None,
                  stop_token_ids=_field(body, "stop_token_ids"))
    try:
        params = SamplingParams(**kwargs)
    except FieldError as e:               # the field it names, and what it expects
        name = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs" if chat else "logprobs",
                "prompt_logprobs": "logprobs"}.get(e.field, e.field)
        raise bad(name, f"expected {e.expected} (got {json.dumps(kwargs.get(e.field))[:40]})") from None
    return params, stream, include_usage


def continuous_usage(body: dict) -> bool:
    """Whether every chunk carries its choice's usage so far: vLLM's stream_options.continuous_usage_stats, which
    (as in vLLM) takes effect with include_usage. Call after sampling_params has checked the options."""
    options = body.get("stream_options") or {}
    return options.get("include_usage") is True and options.get("continuous_usage_stats") is True


def completion_request(body: dict, served: str) -> ParsedRequest:
    model = check_model(body, served)
    prompt = body.get("prompt")
    # a string, a list of token ids, or a batch of either (the openai client sends one prompt as a batch of one)
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    for i, p in enumerate(batch):
        name = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad(name, "is empty")
        elif not (isinstance(p, list) and p and all(is_int(t) for t in p)):
            raise bad(name, f"expected a string or a list of token ids, got {json.dumps(p)[:40]}")
    params, stream, include_usage = sampling_params(body)
    return check_choices(ParsedRequest(batch[0], params, stream, include_usage, model, _field(body, "echo", False),
                                       batch if len(batch) > 1 else None, continuous_usage(body)))


def check_choices(req: ParsedRequest) -> ParsedRequest:
    """At most MAX_CHOICES choices (prompts x n) in one request."""
    if req.num_choices > MAX_CHOICES:
        raise bad("n" if req.params.n > 1 else "prompt",
                  f"{req.num_choices} choices (prompts x n) asked for; at most {MAX_CHOICES} in one request")
    return req


def chat_messages(body: dict) -> list[dict]:
    """The messages, each {"role", "content"} with content a string (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "expected an object with a string role")
        content = m.get("content")
        if isinstance(content, list):          # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"expected a string, got {json.dumps(content)[:40]}")
        out.append({"role": m["role"], "content": content})
    return out


# --- responses -------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache held (`prompt_tokens_details.cached_tokens`)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


_LOGPROB_FLOOR = -9999.0   # a -inf log-probability is not JSON: vLLM's stand-in


def _lp(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


def completion_logprobs(decode, token_ids: list[int], entries: list, offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: each token's text, its log-probability (null for a prompt's first
    token), the top ones by text, and where each token's text starts. entries: TokenLogprobs (or None) per token."""
    tokens = [decode([t]) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else _lp(e[t].logprob) for t, e in zip(token_ids, entries)],
            "top_logprobs": [None if e is None else {decode([tid]): _lp(lp.logprob) for tid, lp in e.items()}
                             for e in entries],
            "text_offset": offsets}


def chat_logprobs(decode, token_ids: list[int], entries: list, top_k: int) -> dict:
    """OpenAI's chat `logprobs`: per generated token its text, bytes, log-probability and the top_k most likely."""
    def item(tid: int, value: float) -> dict:
        text = decode([tid])
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode())}
    return {"content": [item(t, e[t].logprob) | {"top_logprobs": [
                item(tid, lp.logprob) for tid, lp in sorted(e.items(), key=lambda kv: kv[1].rank)[:top_k]]}
                        for t, e in zip(token_ids, entries)]}


def completion_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
                     include_usage: bool) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None                # OpenAI: null in every chunk but the last
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict, finish_reason: str | None,
               include_usage: bool) -> dict:
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, obj: str, model: str, created: int, u: dict) -> dict:
    """The extra last chunk of stream_options.include_usage: no choices, the usage of the whole request."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": u}


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def now() -> int:
    return int(time.time())
