"""The engine behind the server: its loop on a thread, requests joining a running batch, aborts that free
blocks, a bounded waiting queue. Every wait is bounded (asyncio.wait_for); the loop thread is a daemon."""
import asyncio

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.async_engine import AsyncLLMEngine, QueueFull

PROMPTS = ["def add(a, b):", "import os\n", "class Cache:\n    def", "for i in range("]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LIMIT_S = 60


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def offline(llm):
    """The offline engine's greedy tokens, computed before any front runs: one thread drives an engine."""
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def front(llm, offline):
    f = AsyncLLMEngine(llm.engine, max_queued_requests=2)
    yield f
    f.shutdown()
    assert not f._thread.is_alive()


async def collect(front, request_id, prompt, params=GREEDY):
    outs = [out async for out in front.generate(request_id, prompt, params)]
    return outs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, LIMIT_S))


def test_concurrent_requests_match_the_offline_engine(llm, offline, front):

    async def main():
        return await asyncio.gather(*(collect(front, f"r{i}", p) for i, p in enumerate(PROMPTS)))
    streams = run(main())
    assert [s[-1].outputs[0].token_ids for s in streams] == offline
    for s in streams:
        assert s[-1].finished and all(not o.finished for o in s[:-1])
        assert "".join(o.outputs[0].text_delta for o in s) == s[-1].outputs[0].text   # deltas add up
    assert llm.engine.metrics()["kv_blocks_free"] == llm.engine.metrics()["kv_blocks_total"]


def test_a_stream_interval_hands_over_every_nth_token_and_loses_no_text(llm, offline):
    """stream_interval=5: the first token at once, then every fifth, and the last; the deltas still add up to the
    text, and the tokens are the offline engine's."""
    front = AsyncLLMEngine(llm.engine, stream_interval=5)
    try:
        async def main():
            return await asyncio.gather(*(collect(front, f"s{i}", p) for i, p in enumerate(PROMPTS)))
        streams = run(main())
    finally:
        front.shutdown()
    assert [s[-1].outputs[0].token_ids for s in streams] == offline
    for s in streams:
        counts = [len(o.outputs[0].token_ids) for o in s]
        assert counts[0] == 1 and counts[-1] == GREEDY.max_tokens, counts
        assert all(b - a == 5 for a, b in zip(counts[:-2], counts[1:-1])) and 0 < counts[-1] - counts[-2] <= 5, counts
        assert "".join(o.outputs[0].text_delta for o in s) == s[-1].outputs[0].text
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncLLMEngine(llm.engine, stream_interval=0)


def test_a_late_request_joins_the_running_batch(llm, front):
    async def main():
        started = asyncio.Event()

        async def long_reader():
            outs = []
            async for out in front.generate("long", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)):
                outs.append(out)
                started.set()   # the long request is decoding
            return outs
        long = asyncio.create_task(long_reader())
        await started.wait()
        short = await collect(front, "short", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
        return short, long.done(), await long
    short, long_was_done, long = run(main())
    assert short[-1].finished and not long_was_done   # served while the long one was still decoding
    assert len(long[-1].outputs[0].token_ids) == 200


def test_leaving_the_stream_aborts_and_frees_the_blocks(llm, front):
    async def main():
        async for out in front.generate("gone", PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 3:
                break   # the client went away
        for _ in range(200):   # the abort lands at the next step boundary
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
    run(main())
    m = llm.engine.metrics()
    assert not llm.engine.has_unfinished() and m["kv_blocks_free"] == m["kv_blocks_total"]


def test_a_bad_request_fails_alone(llm, front):
    async def main():
        bad = collect(front, "bad", [llm.model.config.vocab_size + 5])
        good = collect(front, "good", PROMPTS[0])
        return await asyncio.gather(bad, good, return_exceptions=True)
    bad, good = run(main())
    assert isinstance(bad, ValueError) and "token ids" in str(bad)
    assert good[-1].finished and good[-1].outputs[0].token_ids


def test_the_waiting_queue_is_bounded(llm):
    front = AsyncLLMEngine(llm.engine, max_queued_requests=2)
    try:
        async def main():
            # 4 run (max_num_seqs), 2 may wait; the rest are refused at once
            tasks = [asyncio.create_task(collect(front, f"q{i}", PROMPTS[i % 4],
                                                 SamplingParams(max_tokens=24, ignore_eos=True))) for i in range(10)]
            return await asyncio.gather(*tasks, return_exceptions=True)
        results = run(main())
    finally:
        front.shutdown()
    refused = [r for r in results if isinstance(r, QueueFull)]
    served = [r for r in results if isinstance(r, list)]
    assert refused and served and len(refused) + len(served) == 10
    assert all(r[-1].finished for r in served)
    with pytest.raises(ValueError, match="max_queued_requests"):
        AsyncLLMEngine(llm.engine, max_queued_requests=-1)


def test_a_failing_step_fails_its_requests_and_the_loop_serves_the_next(llm, front, monkeypatch):
    real_run, calls = llm.engine.runner.run, []

    def run_once_broken(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("injected kernel failure")
        return real_run(batch)
    monkeypatch.setattr(llm.engine.runner, "run", run_once_broken)

    async def main():
        first = await asyncio.gather(collect(front, "doomed", PROMPTS[0]), return_exceptions=True)
        second = await collect(front, "next", PROMPTS[1])
        return first[0], second
    failed, served = run(main())
    assert isinstance(failed, RuntimeError) and "doomed" in str(failed) and "injected kernel failure" in str(failed)
    assert served[-1].finished and len(served[-1].outputs[0].token_ids) == GREEDY.max_tokens
    m = llm.engine.metrics()
    assert not llm.engine.has_unfinished() and m["kv_blocks_free"] == m["kv_blocks_total"]


def test_the_queued_prompt_tokens_are_bounded(llm):
    front = AsyncLLMEngine(llm.engine, max_queued_prompt_tokens=40)
    ids = llm.tokenizer.encode("x = [1, 2, 3]\n" * 2)      # ~20 tokens each
    try:
        async def main():
            tasks = [asyncio.create_task(collect(front, f"t{i}", ids, SamplingParams(max_tokens=24, ignore_eos=True)))
                     for i in range(8)]
            return await asyncio.gather(*tasks, return_exceptions=True)
        results = run(main())
    finally:
        front.shutdown()
    refused = [r for r in results if isinstance(r, QueueFull)]
    assert refused and "max_queued_prompt_tokens = 40" in str(refused[0])
    assert all(r[-1].finished for r in results if isinstance(r, list))


class _EngineSurface:
    """Only the engine's public surface (metrics, add_request, step, abort, has_unfinished, running_request_ids),
    forwarded to a real engine: the front must not need its scheduler or block manager."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name not in {"metrics", "add_request", "step", "abort", "has_unfinished", "running_request_ids"}:
            raise AttributeError(f"the async front reached past the engine's public surface: {name}")
        return getattr(self._engine, name)


def test_the_front_reads_only_the_engines_public_surface(llm, offline):
    front = AsyncLLMEngine(_EngineSurface(llm.engine), max_queued_requests=8)
    try:
        async def all_prompts():
            return await asyncio.gather(*(collect(front, f"s{i}", p) for i, p in enumerate(PROMPTS)))
        outs = run(all_prompts())
        assert [o[-1].outputs[0].token_ids for o in outs] == offline
        assert front.num_waiting() == 0 and front.snapshot["num_running"] == 0
    finally:
        front.shutdown()
