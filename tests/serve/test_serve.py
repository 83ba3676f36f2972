"""The OpenAI-compatible server, end to end over loopback: the real `openai` client and raw httpx against
`python -m nanoserve serve` in a subprocess, checked against the offline engine's greedy outputs.

Every server binds 127.0.0.1 on a free port; every wait is bounded (client timeouts, polls with deadlines);
every server process is killed at the end of its module even when a test fails.
"""
import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.serve.chat import ChatTemplate
from nanoserve.ports import free_port
from nanoserve.serve.load import start_server
from nanoserve import COURSE_MODEL

pytestmark = pytest.mark.slow
PROMPTS = ["def add(a, b):", "import os\n", "class Cache:\n    def", "for i in range(", "# sort a list\n"]
MAX_TOKENS = 12
TIMEOUT = httpx.Timeout(60.0)
SERVE = [sys.executable, "-m", "nanoserve", "serve", "--host", "127.0.0.1"]


@pytest.fixture(scope="module")
def offline():
    """The offline engine's greedy text for each prompt, and for each prompt sent as a chat message."""
    llm = LLM(max_num_seqs=8, max_model_len=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    template = ChatTemplate.for_model(COURSE_MODEL)
    chats = [llm.tokenizer.encode(template.render([{"role": "user", "content": p}]), False) for p in PROMPTS]
    chat_texts = [o.outputs[0].text for o in llm.generate(chats, greedy, use_tqdm=False)]
    return dict(zip(PROMPTS, texts)), dict(zip(PROMPTS, chat_texts))


@pytest.fixture(scope="module")
def server():
    """The server most tests share: room for 16 sequences, no queue bound."""
    port = free_port()
    with start_server(SERVE + ["--port", str(port), "--max-num-seqs", "16", "--max-model-len", "1024"], port) as url:
        yield url


@pytest.fixture(scope="module")
def small():
    """A server with a 2-sequence batch, at most 2 waiting, and an API key."""
    port = free_port()
    with start_server(SERVE + ["--port", str(port), "--max-num-seqs", "2", "--max-queued-requests", "2",
                               "--api-key", "sesame", "--max-model-len", "256"], port) as url:
        yield url


def client(url, key="unused"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60.0)


def metric(url, name, before_first: float | None = None) -> float:
    """The sum of a metric's samples. A labelled counter has none until its first event: `before_first` is its
    value then (a fresh server that has finished no request yet), or None to require the metric."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    if not values and before_first is not None and f"# TYPE {name} counter" in text:
        return before_first
    assert values, f"{name} not in /metrics"
    return sum(values)


def wait_idle(url, deadline_s=30.0):
    """Poll /metrics until nothing runs and no KV block is held (aborts land at the next step boundary)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if metric(url, "vllm:num_requests_running") == 0 and metric(url, "vllm:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server did not go idle in {deadline_s} s: running "
                         f"{metric(url, 'vllm:num_requests_running')}, kv usage {metric(url, 'vllm:kv_cache_usage_perc')}")


def sse_events(response) -> list:
    """The events of a streamed response, checking the framing: `data: ...` lines, each followed by a blank one."""
    events, lines = [], list(response.iter_lines())
    for i in range(0, len(lines), 2):
        assert lines[i].startswith("data: "), f"event {i // 2} is {lines[i]!r}"
        assert i + 1 == len(lines) or lines[i + 1] == "", f"event {i // 2} is not followed by a blank line"
        data = lines[i][len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_openai_client_completions_equal_the_offline_engine(server, offline):
    texts, _ = offline
    c = client(server)
    for prompt in PROMPTS[:3]:
        r = c.completions.create(model="course", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == texts[prompt]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
        streamed = c.completions.create(model="course", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True)
        chunks = list(streamed)
        assert "".join(ch.choices[0].text for ch in chunks) == texts[prompt]
        assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"


def test_openai_client_chat_equals_the_offline_engine(server, offline):
    _, chat_texts = offline
    c = client(server)
    prompt = PROMPTS[0]
    messages = [{"role": "user", "content": prompt}]
    r = c.chat.completions.create(model="course", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == chat_texts[prompt]
    chunks = list(c.chat.completions.create(model="course", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat_texts[prompt]


def test_logprobs_and_echo_through_the_openai_client_equal_the_offline_engine(server):
    """Completions with echo and logprobs (lm-eval's loglikelihood request), streamed and not, and chat's
    logprobs and top_logprobs: the numbers the offline engine gives for the same tokens (tests/engine/
    test_logprobs.py checks those against a plain forward)."""
    llm = LLM(max_num_seqs=8, max_model_len=1024)
    tok = llm.tokenizer
    want = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                                                    prompt_logprobs=2), use_tqdm=False)[0]
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    entries = want.prompt_logprobs + want.outputs[0].logprobs
    c = client(server)
    got = c.completions.create(model="course", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                               echo=True).choices[0]
    assert got.text == PROMPTS[0] + want.outputs[0].text
    lp = got.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - e[t].logprob) for a, e, t in zip(lp.token_logprobs[1:], entries[1:], ids[1:])) < 1e-4
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])        # the token itself and the top 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    streamed = [ch.choices[0] for ch in c.completions.create(model="course", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                               temperature=0, logprobs=2, echo=True, stream=True)]
    assert "".join(ch.text for ch in streamed) == got.text
    assert [t for ch in streamed if ch.logprobs for t in ch.logprobs.tokens] == lp.tokens
    assert [v for ch in streamed if ch.logprobs for v in ch.logprobs.token_logprobs] == lp.token_logprobs
    plain = c.completions.create(model="course", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).choices[0]
    assert plain.logprobs is None and plain.text == want.outputs[0].text
    # chat: logprobs of the generated tokens, each with its top 3
    template = ChatTemplate.for_model(COURSE_MODEL)
    chat_ids = tok.encode(template.render([{"role": "user", "content": PROMPTS[1]}]), False)
    chat_want = llm.generate([chat_ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3),
                             use_tqdm=False)[0].outputs[0]
    content = c.chat.completions.create(model="course", messages=[{"role": "user", "content": PROMPTS[1]}],
                                        max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                        top_logprobs=3).choices[0].logprobs.content
    assert [x.token for x in content] == [tok.decode([t]) for t in chat_want.token_ids]
    for x, t, e in zip(content, chat_want.token_ids, chat_want.logprobs):
        assert abs(x.logprob - e[t].logprob) < 1e-4 and x.bytes == list(x.token.encode())
        ranked = sorted(e.items(), key=lambda kv: kv[1].rank)[:3]
        assert [(y.token, round(y.logprob, 4)) for y in x.top_logprobs] == \
               [(tok.decode([tid]), round(v.logprob, 4)) for tid, v in ranked]
    streamed = [ch.choices[0] for ch in c.chat.completions.create(
        model="course", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, stream=True) if ch.choices]
    assert [x.token for ch in streamed if ch.logprobs for x in ch.logprobs.content] == [x.token for x in content]


def test_penalties_bias_min_tokens_and_min_p_through_the_openai_client_equal_the_offline_engine(server):
    llm = LLM(max_num_seqs=8, max_model_len=1024)
    c = client(server)
    stop_id = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids[2]
    cases = [dict(presence_penalty=1.5, frequency_penalty=0.5), dict(logit_bias={"123": 100}),
             dict(extra_body=dict(repetition_penalty=1.8, min_p=0.5)),
             dict(extra_body=dict(stop_token_ids=[stop_id], min_tokens=6))]
    for kw in cases:
        fields = {**kw.get("extra_body", {}), **{k: v for k, v in kw.items() if k != "extra_body"}}
        if "logit_bias" in fields:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        want = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **fields),
                            use_tqdm=False)[0].outputs[0]
        got = c.completions.create(model="course", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, **kw)
        assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids), kw
        chat = c.chat.completions.create(model="course", messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=MAX_TOKENS, temperature=0, **kw)
        assert chat.choices[0].message.content is not None, kw
    assert want.token_ids[:6].count(stop_id) == 0      # min_tokens held the stop token back


def test_n_samples_and_prompt_batches_equal_the_offline_engine(server):
    """n samples of a prompt (seeded: each its own seed, reproducible) and a batch of prompts in one request:
    one choice each, in the offline engine's order (prompt, then sample), usage summed."""
    llm = LLM(max_num_seqs=8, max_model_len=1024)
    c = client(server)
    want = llm.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS), use_tqdm=False)
    got = c.completions.create(model="course", prompt=PROMPTS[:2], n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS)
    assert [ch.index for ch in got.choices] == list(range(6))
    assert [ch.text for ch in got.choices] == [o.text for r in want for o in r.outputs]
    assert len({ch.text for ch in got.choices[:3]}) > 1, "three samples of one prompt, three seeds"
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in want)
    assert got.usage.completion_tokens == sum(len(o.token_ids) for r in want for o in r.outputs)
    greedy = c.completions.create(model="course", prompt=[PROMPTS[2], PROMPTS[3]], max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=1, echo=True)
    offline = llm.generate(PROMPTS[2:4], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [ch.text for ch in greedy.choices] == [p + o.outputs[0].text for p, o in zip(PROMPTS[2:4], offline)]
    assert all(ch.logprobs.token_logprobs[0] is None for ch in greedy.choices)
    chat = c.chat.completions.create(model="course", messages=[{"role": "user", "content": PROMPTS[0]}], n=2,
                                     temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.choices[0].message.content != chat.choices[1].message.content
    wait_idle(server)


def test_several_choices_stream_interleaved_and_equal_the_answer_not_streamed(server):
    """n samples of a batch of prompts, streamed: each chunk carries one choice under its index, the choices'
    chunks interleave (they decode in the same steps), and each choice's text, logprobs and finish reason equal
    the non-streamed answer's; one usage chunk sums them. Chat streams each choice's role first."""
    c = client(server)
    kw = dict(model="course", prompt=PROMPTS[:2], n=2, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, logprobs=2)
    whole = c.completions.create(**kw)
    texts, tokens, reasons, order = defaultdict(str), defaultdict(list), {}, []
    stream = c.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (ch,) = chunk.choices
        order.append(ch.index)
        texts[ch.index] += ch.text
        tokens[ch.index] += ch.logprobs.tokens if ch.logprobs else []
        reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert sorted(texts) == [0, 1, 2, 3]
    assert [texts[k] for k in range(4)] == [ch.text for ch in whole.choices]
    assert [tokens[k] for k in range(4)] == [ch.logprobs.tokens for ch in whole.choices]
    assert [reasons[k] for k in range(4)] == [ch.finish_reason for ch in whole.choices]
    assert order.index(3) < len(order) - order[::-1].index(0) - 1, "choice 3 began before choice 0 ended"
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)

    chat = c.chat.completions.create(model="course", messages=[{"role": "user", "content": PROMPTS[0]}], n=3,
                                     temperature=1.0, seed=3, max_tokens=MAX_TOKENS, stream=True)
    roles, content = {}, defaultdict(str)
    for chunk in chat:
        (ch,) = chunk.choices
        roles.setdefault(ch.index, ch.delta.role)
        content[ch.index] += ch.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    whole_chat = c.chat.completions.create(model="course", messages=[{"role": "user", "content": PROMPTS[0]}], n=3,
                                           temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    assert [content[k] for k in range(3)] == [ch.message.content for ch in whole_chat.choices]
    wait_idle(server)


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context(small):
    r = httpx.post(f"{small}/v1/chat/completions", headers={"Authorization": "Bearer sesame"}, timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "ignore_eos": True})
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 256, r.text[:300]
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_framing_and_the_usage_chunk(server, route):
    body = {"model": "course", "max_tokens": 6, "temperature": 0, "stream": True}
    body |= {"prompt": PROMPTS[1]} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{server}/v1/{route}", json=body | {"stream_options": {"include_usage": True}},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in events[:-2])   # null until the last
    with httpx.stream("POST", f"{server}/v1/{route}", json=body, timeout=TIMEOUT) as r:
        plain = sse_events(r)
    assert plain[-1] == "[DONE]" and all("usage" not in e and len(e["choices"]) == 1 for e in plain[:-1])
    # stream_options without stream is a 400 that names it
    r = httpx.post(f"{server}/v1/{route}", json=body | {"stream": False, "stream_options": {"include_usage": True}},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


LONG = "x = 1\n" * 700   # about 2800 tokens: over max_model_len 1024
BAD_REQUESTS = [   # (body or raw bytes, status, the field the error names)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, -5]}, 400, "prompt"),
    ({"prompt": LONG}, 400, "prompt"),
    ({"prompt": "def f", "max_tokens": 2000}, 400, "max_tokens"),
    ({"prompt": "def f", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "def f", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "def f", "temperature": -1}, 400, "temperature"),
    ({"prompt": "def f", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "def f", "top_p": 0}, 400, "top_p"),
    ({"prompt": "def f", "top_k": 1.5}, 400, "top_k"),
    ({"prompt": "def f", "seed": True}, 400, "seed"),
    ({"prompt": "def f", "seed": 10**30}, 400, "seed"),
    ({"prompt": "def f", "stop": [1]}, 400, "stop"),
    ({"prompt": "def f", "n": 0}, 400, "n"),
    ({"prompt": "def f", "n": 10**30}, 400, "n"),
    ({"prompt": "def f", "logprobs": 21}, 400, "logprobs"),            # OpenAI's and vLLM's limit is 20
    ({"prompt": "def f", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "def f", "echo": "yes"}, 400, "echo"),
    ({"prompt": "def f", "stream": "yes"}, 400, "stream"),
    ({"prompt": "def f", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ({"prompt": "def f", "model": "gpt-4"}, 404, "model"),
    ({"prompt": ["a", ""]}, 400, "prompt[1]"),
    ({"prompt": ["a", 5]}, 400, "prompt"),
    (b'{"prompt": "def f", "temperature": 1e999}', 400, "temperature"),      # parsed as inf
    (b'{"prompt": "def f", "top_p": NaN}', 400, "top_p"),                    # Python's json reads NaN
    ({"prompt": "def f", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "def f", "stop_token_ids": 5}, 400, "stop_token_ids"),
    # fields the engine does not implement: a 400 that names them, never silently ignored
    ({"prompt": "def f", "min_tokens": 20}, 400, "min_tokens"),          # more than max_tokens (16)
    ({"prompt": "def f", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "def f", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "def f", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "def f", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "def f", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "def f", "logit_bias": [5]}, 400, "logit_bias"),
    ({"prompt": "def f", "logit_bias": {"99999999": 1}}, 400, None),      # not in the vocabulary: the engine says so
    ({"prompt": "def f", "include_stop_str_in_output": True}, 400, "include_stop_str_in_output"),
    ({"prompt": "def f", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": "def f", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, 400,
     "stream_options.continuous_usage_stats"),
]


def test_bad_requests_get_4xx_with_openai_error_json_and_the_server_keeps_serving(server, offline):
    texts, _ = offline
    for body, status, param in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{server}/v1/completions", timeout=TIMEOUT, headers={"content-type": "application/json"},
                       **kwargs)
        assert r.status_code == status, (body if isinstance(body, bytes) else str(body)[:80], r.text[:200])
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == status and error["message"], error
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": 3}]},
                                                          "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
                         "max_completion_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
                        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
                         "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
                        ({"messages": [{"role": "user", "content": "hi"}], "n": 129}, "n")]:
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                     "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[PROMPTS[0]]


def test_stop_token_ids_end_a_completion_where_the_offline_engine_ends_it(server):
    llm = LLM(max_num_seqs=8, max_model_len=1024)
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    full = llm.generate([PROMPTS[0]], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[3]
    cut = llm.generate([PROMPTS[0]], SamplingParams(**greedy, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[0], **greedy, "stop_token_ids": [stop_id]},
                   timeout=TIMEOUT)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "stop" and choice["text"] == cut.text, r.text


def test_64_concurrent_streams_over_rounds_all_complete_and_leak_nothing(server, offline):
    texts, _ = offline

    async def one(http, prompt):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        text, usage = [], None
        async with http.stream("POST", f"{server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if event["choices"]:
                        text.append(event["choices"][0]["text"])
                    else:
                        usage = event["usage"]
        return "".join(text), usage

    async def rounds(n_rounds, n_clients):
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=n_clients)) as http:
            results = []
            for _ in range(n_rounds):
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_clients)]
                results += list(zip(prompts, await asyncio.gather(*(one(http, p) for p in prompts))))
            return results

    before = metric(server, "vllm:request_success_total", before_first=0.0)
    results = asyncio.run(asyncio.wait_for(rounds(3, 64), 240))
    assert len(results) == 3 * 64
    for prompt, (text, usage) in results:
        assert text == texts[prompt] and usage["completion_tokens"] == MAX_TOKENS
    assert metric(server, "vllm:request_success_total") - before == 3 * 64
    wait_idle(server)
    assert metric(server, "vllm:num_requests_waiting") == 0


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    wait_idle(server)
    aborted = metric(server, "vllm:request_success_total", before_first=0.0)   # this test may be the server's first
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        for _ in range(6):   # three events in
            next(lines)
        assert metric(server, "vllm:kv_cache_usage_perc") > 0 and metric(server, "vllm:num_requests_running") == 1
    wait_idle(server)        # closing the connection aborted the request: nothing runs, every block is back
    text = httpx.get(f"{server}/metrics", timeout=TIMEOUT).text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="course"}' in text
    assert metric(server, "vllm:request_success_total") == aborted + 1
    # a stream of three choices: leaving aborts all three
    with httpx.stream("POST", f"{server}/v1/completions", json=body | {"n": 3, "temperature": 1.0},
                      timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        for _ in range(12):
            next(lines)
        assert metric(server, "vllm:num_requests_running") == 3
    wait_idle(server)
    assert metric(server, "vllm:request_success_total") == aborted + 4


def test_a_non_streaming_client_that_times_out_has_its_request_aborted(server):
    wait_idle(server)
    aborted = metric(server, "vllm:request_success_total", before_first=0.0)
    aborts = aborted_count(server)
    with pytest.raises(httpx.ReadTimeout):   # about 900 tokens to generate: the client gives up after a second
        httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 900, "ignore_eos": True},
                   timeout=httpx.Timeout(60.0, read=1.0))
    wait_idle(server)
    assert aborted_count(server) == aborts + 1                  # aborted, not run on to its "length"
    assert metric(server, "vllm:request_success_total") == aborted + 1


def test_streams_whose_clients_leave_while_queued_are_never_admitted(small):
    """Two long requests fill the 2-sequence batch; two streams queue behind them and their clients leave before
    a first token. They are aborted where they wait: the prefix cache never looks them up (admission does)."""
    import threading
    key = {"Authorization": "Bearer sesame"}
    long = {"prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True}   # about all the 256-token context allows
    threads = [threading.Thread(target=httpx.post, args=(f"{small}/v1/completions",),
                                kwargs=dict(json=long, headers=key, timeout=TIMEOUT)) for _ in range(2)]
    finished = metric(small, "vllm:request_success_total", before_first=0.0)
    aborts = aborted_count(small)
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while metric(small, "vllm:num_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        looked_up = metric(small, "vllm:prefix_cache_queries_total")

        def leave_before_a_token(prompt):      # no first token while the batch is full: the client leaves
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{small}/v1/completions", headers=key, timeout=httpx.Timeout(60.0, read=0.25),
                           json={"prompt": prompt, "max_tokens": 4, "stream": True})
        # both at once, so the long requests need to hold the batch for one short read timeout only (their 240
        # tokens took between 0.5 and 1 s on a fast 2-core CPU, where two timeouts one after the other outlasted them)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(leave_before_a_token, PROMPTS[3:5]))
        assert metric(small, "vllm:num_requests_running") == 2, "the long requests must still hold the batch"
    finally:
        for t in threads:
            t.join(60)
    wait_idle(small)
    assert metric(small, "vllm:prefix_cache_queries_total") == looked_up, "a stream whose client left was admitted"
    assert metric(small, "vllm:request_success_total") == finished + 4      # the two long ones and two aborts
    assert aborted_count(small) == aborts + 2


def aborted_count(url) -> float:
    """vllm:request_success_total{finished_reason="abort"}: 0 before the server's first abort."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)


def test_tokenize_detokenize_models_and_health(server):
    r = httpx.post(f"{server}/tokenize", json={"prompt": "def add(a, b):"}, timeout=TIMEOUT).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    back = httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"]}, timeout=TIMEOUT).json()
    assert back["prompt"] == "def add(a, b):"
    assert httpx.post(f"{server}/detokenize", json={"tokens": "abc"}, timeout=TIMEOUT).status_code == 400
    assert client(server).models.list().data[0].id == "course"
    assert client(server).models.retrieve("course").id == "course"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4")
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{server}/ping", timeout=TIMEOUT).status_code == 200
    assert httpx.post(f"{server}/ping", timeout=TIMEOUT).status_code == 200
    from nanoserve import __version__
    assert httpx.get(f"{server}/version", timeout=TIMEOUT).json() == {"version": __version__}
    # a route or a method the server does not have: OpenAI's error JSON all the same
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)]:
        r = httpx.request(method, f"{server}{path}", timeout=TIMEOUT)
        error = r.json()["error"]
        assert r.status_code == status and error["code"] == status and path in error["message"], r.text


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(server):
    prompt = "import os\nimport sys\n" * 8        # several full blocks
    first, again = (httpx.post(f"{server}/v1/completions", timeout=TIMEOUT, json={
        "prompt": prompt, "max_tokens": 2, "temperature": 0}).json()["usage"] for _ in range(2))
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < again["prompt_tokens"], again


def test_api_key_guards_v1_but_not_health_or_metrics(small):
    assert httpx.get(f"{small}/v1/models", timeout=TIMEOUT).status_code == 401
    r = httpx.post(f"{small}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"},
                   timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    with pytest.raises(openai.AuthenticationError):
        client(small, "wrong").models.list()
    assert client(small, "sesame").models.list().data[0].id == "course"
    assert httpx.get(f"{small}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{small}/metrics", timeout=TIMEOUT).status_code == 200


def test_a_burst_past_the_queue_bound_gets_429s_and_the_rest_complete(small):
    headers = {"Authorization": "Bearer sesame"}

    async def one(http, i):
        r = await http.post(f"{small}/v1/completions", headers=headers,
                            json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 48, "ignore_eos": True})
        return r

    async def burst():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            return await asyncio.gather(*(one(http, i) for i in range(12)))

    responses = asyncio.run(asyncio.wait_for(burst(), 120))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) >= 6 and codes.count(200) >= 4, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "RateLimitError"
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    wait_idle(small)


def wait_healthy(proc, url, timeout_s: float = 60) -> float:
    """Poll a server process's /health until it answers (the process must stay alive); returns the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return deadline
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


def test_sigterm_drains_what_can_finish_and_answers_the_rest_at_the_deadline():
    """SIGTERM mid-stream: a stream that can finish within --shutdown-timeout finishes ("length", [DONE]); two
    streams and a non-streamed request that cannot are answered a second before the deadline: each stream's last
    events are a 503 error event and [DONE], the other request a 503 in OpenAI's shape. One log line says so, no
    traceback, exit 0, and the port is closed."""
    import threading
    port = free_port()
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--max-num-seqs", "4", "--max-model-len", "1024",
                                     "--shutdown-timeout", "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    long = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True}
    answers = {}

    def stream(i):
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=TIMEOUT) as r:
            answers[i] = [line for line in r.iter_lines() if line]

    def plain():
        r = httpx.post(f"{url}/v1/completions", json=long, timeout=TIMEOUT)
        answers["plain"] = (r.status_code, r.json())

    try:
        deadline = wait_healthy(proc, url)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)] + [threading.Thread(target=plain)]
        for t in threads:
            t.start()
        while metric(url, "vllm:num_requests_running") < 3:     # the three long ones started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        short = {"prompt": PROMPTS[1], "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=short, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)      # mid-stream: this one can finish in time
            events = [first] + [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):   # and it no longer listens
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=10)[0]
    for i in range(2):
        events = answers[i]
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and "shutting down" in error["message"]
    status, body = answers["plain"]
    assert status == 503 and "shutting down" in body["error"]["message"], body
    assert "stopped" in out and "Traceback" not in out, out[-3000:]
    assert out.count("stopping the requests still in flight") == 1, out[-3000:]


def test_random_bodies_never_get_a_5xx(server, offline):
    """A small fuzz: 150 bodies mixing valid and hostile values of every field; each answer is a 2xx or a
    4xx with OpenAI's error JSON, and the server still answers a good request exactly afterwards."""
    import random
    rng = random.Random(0)
    pool = [None, -1, 0, 1, 2, 0.5, 1.5, -0.0, 1e308, 10**30, -10**30, float("nan"), float("inf"), True, False,
            "", "x", "def f(x):", "\u0000\ud7ff", [], [1], [1, "a"], [10**9], {}, {"include_usage": True}, "ä" * 3000]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
              "n", "logprobs", "top_logprobs", "echo", "ignore_eos", "model", "messages", "max_completion_tokens",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias"]
    texts, _ = offline

    async def one(http, i):
        body = {f: rng.choice(pool) for f in rng.sample(fields, rng.randint(1, 6))}
        body.setdefault("prompt", rng.choice(["def f(x):", [5, 6, 7]]))
        for name in ("max_tokens", "max_completion_tokens"):   # valid lengths kept short: the fuzz is about the answers
            if isinstance(body.get(name), int) and not isinstance(body[name], bool) and 0 < body[name] < 10**6:
                body[name] = min(body[name], 8)
        route = rng.choice(["completions", "chat/completions"])
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 8      # a chat without one may run to the end of the context (tested apart)
        r = await http.post(f"{server}/v1/{route}", content=json.dumps(body).encode(),
                            headers={"content-type": "application/json"})
        if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
            return body, route, r.status_code, r.text[:300]
        return None

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            return await asyncio.gather(*(one(http, i) for i in range(150)))

    failures = [f for f in asyncio.run(asyncio.wait_for(main(), 240)) if f]
    assert not failures, failures[:5]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                     "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[PROMPTS[0]]
    wait_idle(server)


def test_a_speculative_server_gives_the_same_text_and_reports_its_drafts(offline):
    texts, _ = offline
    port = free_port()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    with start_server(SERVE + ["--port", str(port), "--max-num-seqs", "4", "--max-model-len", "1024",
                               "--speculative-config", spec], port) as url:
        for prompt in PROMPTS[:3]:
            r = client(url).completions.create(model="course", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert r.choices[0].text == texts[prompt]
        assert metric(url, "vllm:spec_decode_num_draft_tokens_total") > 0
        assert 0 < metric(url, "vllm:spec_decode_num_accepted_tokens_total") <= \
            metric(url, "vllm:spec_decode_num_draft_tokens_total")
