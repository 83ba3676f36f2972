"""The openai client's surface, a parameter at a time: each sampling parameter through `completions.create` and
`chat.completions.create`, streamed and not, gives the offline engine's text, finish reason and token count.

tests/serve/test_serve.py already covers logprobs and echo, n and batches of prompts, the usage chunk, and (for
completions, not streamed) the penalties, logit_bias, min_p, min_tokens and stop_token_ids; this file adds the rest
of the matrix: stop strings, seeded sampling with top_k / top_p / min_p, prompts as token ids, max_completion_tokens,
ignore_eos, those parameters streamed and through chat, and vLLM's stream_options.continuous_usage_stats.
"""
import sys

import openai
import pytest

from nanoserve import COURSE_MODEL, LLM, SamplingParams
from nanoserve.ports import free_port
from nanoserve.serve.chat import ChatTemplate
from nanoserve.serve.load import start_server

pytestmark = pytest.mark.slow
PROMPT = "def add(a, b):"
MAX_TOKENS = 12
ROUTES = ("completions", "chat")
# the fields the openai client takes by name; the rest (vLLM's extras) go in extra_body
CLIENT_FIELDS = {"stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias",
                 "max_tokens", "max_completion_tokens"}


def case_fields(case: str, ids: list[int], tok) -> dict:
    """The request's fields for a case, from the route's greedy output tokens `ids` (so a stop really stops, a bias
    really moves): OpenAI's names, vLLM's for its extras."""
    return {
        "stop": {"stop": tok.decode(ids[4:6])},
        "stop_list": {"stop": ["never in this text", tok.decode(ids[3:5])]},
        "seed": {"temperature": 1.0, "seed": 7},
        "top_k": {"temperature": 1.0, "seed": 3, "top_k": 5},
        "top_p": {"temperature": 1.0, "seed": 3, "top_p": 0.5},
        "min_p": {"temperature": 1.0, "seed": 3, "min_p": 0.2},
        "presence_penalty": {"presence_penalty": 1.5},
        "frequency_penalty": {"frequency_penalty": 1.0},
        "repetition_penalty": {"repetition_penalty": 1.5},
        "logit_bias": {"logit_bias": {str(ids[2]): 100}},
        "min_tokens": {"min_tokens": 8, "stop_token_ids": [ids[2]]},
        "stop_token_ids": {"stop_token_ids": [ids[3]]},
        "ignore_eos": {"ignore_eos": True},
        "max_completion_tokens": {"max_completion_tokens": 5},
        "prompt_token_ids": {},
    }[case]


# (case, routes it applies to); cells test_serve.py already checks are left out below
CASES = [(c, ROUTES) for c in ("stop", "stop_list", "seed", "top_k", "top_p", "min_p", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                               "stop_token_ids", "ignore_eos")]
CASES += [("max_completion_tokens", ("chat",)), ("prompt_token_ids", ("completions",))]
COVERED = {("presence_penalty", "completions", False), ("frequency_penalty", "completions", False),
           ("repetition_penalty", "completions", False), ("min_p", "completions", False),
           ("logit_bias", "completions", False), ("min_tokens", "completions", False),
           ("stop_token_ids", "completions", False)}
MATRIX = [pytest.param(case, route, stream, id=f"{case}-{route}-{'stream' if stream else 'whole'}")
          for case, routes in CASES for route in routes for stream in (False, True)
          if (case, route, stream) not in COVERED]


@pytest.fixture(scope="module")
def offline():
    return LLM(max_num_seqs=8, max_model_len=1024)


@pytest.fixture(scope="module")
def prompt_ids(offline):
    """Each route's prompt as the engine sees it: the text, or the chat template's rendering of one message."""
    chat = ChatTemplate.for_model(COURSE_MODEL).render([{"role": "user", "content": PROMPT}])
    return {"completions": offline.tokenizer.encode(PROMPT), "chat": offline.tokenizer.encode(chat, False)}


@pytest.fixture(scope="module")
def greedy(offline, prompt_ids):
    outs = {}
    for route, ids in prompt_ids.items():
        out = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
        outs[route] = out.outputs[0].token_ids
    return outs


@pytest.fixture(scope="module")
def client():
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", "8", "--max-model-len", "1024"]
    with start_server(cmd, port, timeout_s=90) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def ask(client, route: str, fields: dict, stream: bool, prompt=PROMPT):
    """(text, finish reason, completion tokens) through the openai client, streamed or not."""
    fields = {"temperature": 0, **fields}
    if "max_completion_tokens" not in fields:
        fields["max_tokens"] = MAX_TOKENS
    kwargs = {k: v for k, v in fields.items() if k in CLIENT_FIELDS}
    kwargs["extra_body"] = {k: v for k, v in fields.items() if k not in CLIENT_FIELDS}
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    if route == "completions":
        answer = client.completions.create(model="course", prompt=prompt, **kwargs)
    else:
        answer = client.chat.completions.create(model="course", messages=[{"role": "user", "content": prompt}], **kwargs)
    if not stream:
        choice = answer.choices[0]
        return (choice.text if route == "completions" else choice.message.content), choice.finish_reason, \
            answer.usage.completion_tokens
    text, reason, usage = "", None, None
    for chunk in answer:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text if route == "completions" else (choice.delta.content or "")
            reason = choice.finish_reason or reason
    return text, reason, usage.completion_tokens


@pytest.mark.parametrize("case, route, stream", MATRIX)
def test_a_parameter_through_the_openai_client_equals_the_offline_engine(client, offline, prompt_ids, greedy,
                                                                        case, route, stream):
    fields = case_fields(case, greedy[route], offline.tokenizer)
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, **fields}
    if "max_completion_tokens" in params:
        params["max_tokens"] = params.pop("max_completion_tokens")
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    want = offline.generate([prompt_ids[route]], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    if case.startswith("stop"):
        assert want.finish_reason == "stop", "the case must stop early to test anything"
    prompt = prompt_ids[route] if case == "prompt_token_ids" else PROMPT
    got = ask(client, route, fields, stream, prompt)
    assert got == (want.text, want.finish_reason, len(want.token_ids))


@pytest.mark.parametrize("route", ROUTES)
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, route):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it on every request): each chunk's usage
    counts its choice's tokens so far, one more per chunk here, and the last usage chunk the whole."""
    create = client.completions.create if route == "completions" else client.chat.completions.create
    body = {"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    chunks = list(create(model="course", max_tokens=6, temperature=0, stream=True, **body,
                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    first = 0 if route == "chat" else 1            # chat's first chunk carries the role, no token
    assert counts == list(range(first, 7)), counts
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
