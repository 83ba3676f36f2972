"""Chapter 03: the continuous-batching engine behind LLM.generate."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from nanoserve import LLM, SamplingParams

from tiny_models import VOCAB, hf_greedy, random_prompts, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("engine-model"), Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=5))


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("max_num_seqs,budget", [(3, 40), (8, 2048), (2, 7)])
def test_greedy_in_a_mixed_batch_equals_transformers_per_request(model_dir, reference, max_num_seqs, budget):
    """Queued requests, chunked prefills and decodes sharing steps: each output is what it would be alone."""
    lengths, max_tokens = [5, 30, 7, 60, 12, 1, 45], [10, 3, 25, 8, 1, 17, 12]
    prompts = random_prompts(lengths)
    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens],
                        use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(reference, p, m)
        assert o.outputs[0].finish_reason == "length"
    m = llm.metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["num_running"] == m["num_waiting"] == 0
    assert m["prefill_tokens"] == sum(lengths) and m["decode_tokens"] == sum(max_tokens) - len(prompts)


def test_static_scheduling_gives_the_same_tokens_in_more_steps(model_dir):
    prompts = random_prompts([8, 20, 4, 16, 9, 30])
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [30, 2, 3, 25, 4, 2]]
    cont = LLM(str(model_dir), max_num_seqs=3)
    static = LLM(str(model_dir), max_num_seqs=3, scheduling="static")
    a, b = cont.generate(prompts, params, use_tqdm=False), static.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert static.metrics()["steps"] > cont.metrics()["steps"]


def test_stop_conditions(model_dir, reference):
    prompt = random_prompts([6])[0]
    free = hf_greedy(reference, prompt, 20)
    stop_at = free[4]
    llm = LLM(str(model_dir))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(stop_at) + 1]
    # the model's EOS (id 5) stops a request unless ignore_eos; max_model_len caps the sequence
    eos_llm = LLM(str(model_dir), max_model_len=16)
    o = eos_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 16 and o.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(model_dir):
    llm = LLM(str(model_dir))
    llm.engine.scheduler.stopper.eos_token_ids = set(range(VOCAB))  # every token is EOS: stop after one
    o = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 1 and o.finish_reason == "stop"
    o = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "length"


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dir):
    llm = LLM(str(model_dir), max_num_seqs=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=123, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in (3, 20, 7)]
    prompts = random_prompts([9, 4, 11, 6])
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [seeded] + others, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == mixed
    assert llm.generate([prompts[0]], SamplingParams(temperature=1.0, max_tokens=12, seed=124, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids != alone


def test_text_prompts_and_input_forms(model_dir):
    llm = LLM(str(model_dir))
    sp = SamplingParams(temperature=0, max_tokens=4)
    one = llm.generate("def f(x):", sp, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == "def f(x):"
    assert one[0].outputs[0].text == llm.tokenizer.decode(one[0].outputs[0].token_ids)
    ids = llm.tokenizer.encode("def f(x):")
    assert llm.generate(ids, sp, use_tqdm=False)[0].outputs[0].token_ids == one[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts,params,match", [
    ([[1], [2]], [SamplingParams()], "got 2 prompts but 1 SamplingParams"),
    ([[1], 3.5], SamplingParams(), r"prompts\[1\] must be a str or a list of token ids"),
    ([[1]], [{"temperature": 0}], r"sampling_params\[0\] must be a SamplingParams"),
])
def test_malformed_calls_fail_clearly_and_leave_the_engine_working(model_dir, prompts, params, match):
    llm = LLM(str(model_dir), max_num_seqs=2)
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompts, params, use_tqdm=False)
    m = llm.metrics()
    assert m["num_waiting"] == m["num_running"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
    ok = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("bad,match", [
    ([], r"prompts\[1\]: prompt is empty"),
    ([3, VOCAB + 7], rf"prompts\[1\]: prompt token ids must be ints in \[0, {VOCAB}\)"),
    ([1] * 300, r"prompts\[1\]: prompt has 300 tokens; max_model_len is 256"),
])
def test_a_bad_request_fails_alone(model_dir, reference, bad, match):
    """One bad request gets an error output naming the problem; the others in the call complete."""
    good = random_prompts([6, 9])
    llm = LLM(str(model_dir), max_num_seqs=2)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([good[0], bad, good[1]], sp, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert outs[1].error is not None and __import__("re").search(match, outs[1].error)
    for o, p in zip([outs[0], outs[2]], good):
        assert o.error is None and o.outputs[0].token_ids == hf_greedy(reference, p, 5)
    m = llm.metrics()
    assert m["num_waiting"] == m["num_running"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]


def test_engine_config_is_validated(model_dir):
    with pytest.raises(ValueError, match="max_num_seqs = 0"):
        LLM(str(model_dir), max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len = 999 exceeds"):
        LLM(str(model_dir), max_model_len=999)
    with pytest.raises(ValueError, match="scheduling policy 'fifo'"):
        LLM(str(model_dir), scheduling="fifo")
