"""Cache-aware admission: requests that arrive together with a shared prefix compute it once."""
import pytest
from transformers import LlamaConfig

from nanoserve import LLM, SamplingParams

from tiny_models import VOCAB, random_prompts, save_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("admission-model"), LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)))


def together(n=12):
    """n requests over 2 shared 48-token prefixes (3 blocks of 16), each with its own 5-token suffix."""
    heads = random_prompts([48, 48], seed=11)
    tails = random_prompts([5] * n, seed=12)
    return [heads[i % 2] + tails[i] for i in range(n)]


def run(model_dir, prompts, cache_aware=True, **kw):
    llm = LLM(model_dir, max_num_seqs=16, **kw)
    llm.engine.scheduler.defer_shared_prefixes = cache_aware
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_shared_prefixes_hit_the_cache_when_requests_arrive_together(model_dir):
    prompts = together()
    aware, tokens = run(model_dir, prompts)
    plain, plain_tokens = run(model_dir, prompts, cache_aware=False)
    _, uncached = run(model_dir, prompts, enable_prefix_caching=False)
    assert tokens == plain_tokens == uncached                     # admission order changes no output
    # 10 of the 12 reuse 3 full blocks each: 480 of 12 x 53 = 636 prompt tokens; first come, none do
    assert aware.metrics()["prefix_cache_hit_tokens"] == 10 * 48
    assert aware.metrics()["prefix_cache_hit_rate"] > 0.7 > 0.1 > plain.metrics()["prefix_cache_hit_rate"]
    assert aware.metrics()["prefill_tokens"] < plain.metrics()["prefill_tokens"] - 400
    for llm in (aware, plain):
        assert llm.metrics()["kv_blocks_free"] == llm.metrics()["kv_blocks_total"]


def test_requests_without_sharing_are_not_deferred(model_dir):
    prompts = random_prompts([40, 33, 50, 21], seed=13)
    llm, _ = run(model_dir, prompts)
    assert llm.engine.scheduler.num_deferred == 0 and llm.metrics()["steps"] == run(model_dir, prompts, False)[0].metrics()["steps"]


def test_a_deferred_request_follows_one_step_later_even_when_the_computing_one_is_aborted(model_dir):
    """A request is deferred only while a running prompt computes the block it needs, i.e. for the step in
    which that prompt's last chunk runs: one step, whatever happens to the computing request after it."""
    llm = LLM(model_dir, max_num_seqs=16)
    engine = llm.engine
    a, b = together(2)[0], together(3)[2]                             # the same 48-token prefix
    engine.add_request("a", a, PARAMS)
    engine.add_request("b", b, PARAMS)
    engine.step()
    assert [s.seq_id for s in engine.scheduler.running] == ["a"] and engine.scheduler.num_deferred == 1
    engine.abort("a")
    engine.step()
    assert [s.seq_id for s in engine.scheduler.running] == ["b"]
    assert engine.block_manager.hit_tokens == 48                      # a's blocks stayed cached after the abort
    while engine.has_unfinished():
        engine.step()
    assert engine.requests == {} and llm.metrics()["kv_blocks_free"] == llm.metrics()["kv_blocks_total"]


def test_static_scheduling_admits_the_whole_batch(model_dir):
    llm = LLM(model_dir, max_num_seqs=16, scheduling="static")
    llm.generate(together(6), PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.num_deferred == 0


def test_a_deferred_request_is_not_starved_when_the_computing_one_is_preempted(model_dir):
    """b waits on the prefix a computes; the next step a running request needs a block and a, the latest
    admitted, gives way. b is not left waiting on blocks nobody computes: it runs, with the right tokens."""
    head = together(1)[0][:48]
    c, tail_a, tail_b = random_prompts([15, 5, 5], seed=12)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = {"c": (c, long), "a": (head + tail_a, PARAMS), "b": (head + tail_b, PARAMS)}
    reference = LLM(model_dir, enable_prefix_caching=False).generate(
        [p for p, _ in requests.values()], [sp for _, sp in requests.values()], use_tqdm=False)
    # 5 blocks: c holds 1 and needs a 2nd at its 17th token, a's 53 tokens take the other 4
    llm = LLM(model_dir, max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=5, max_model_len=64)
    engine, scheduler = llm.engine, llm.engine.scheduler
    engine.add_request("c", *requests["c"])
    engine.step()                                                   # c's prompt: 16 tokens, one full block
    engine.add_request("a", *requests["a"])
    engine.add_request("b", *requests["b"])
    outputs = {out.request_id: out for out in engine.step()}       # a computes the prefix, b is deferred
    assert [s.seq_id for s in scheduler.running] == ["c", "a"] and scheduler.num_deferred == 1
    outputs |= {out.request_id: out for out in engine.step()}      # c needs a block: a is preempted
    assert scheduler.num_preemptions == 1 and [s.seq_id for s in scheduler.waiting] == ["a", "b"]
    for _ in range(100):
        if not engine.has_unfinished():
            break
        outputs |= {out.request_id: out for out in engine.step()}
    assert not engine.has_unfinished(), "b (or a) never ran"
    assert [outputs[i].outputs[0].token_ids for i in requests] == [r.outputs[0].token_ids for r in reference]
    assert llm.metrics()["kv_blocks_free"] == llm.metrics()["kv_blocks_total"]
