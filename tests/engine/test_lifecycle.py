"""A request's life as a server sees it: string ids, abort, per-step outputs with text deltas, stop strings,
times, and EOS from the checkpoint's generation_config.json."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nanoserve import LLM, SamplingParams
from nanoserve.sampling import sample

from tiny_models import VOCAB, hf_greedy, random_prompts, save_tiny_model

PROMPT = "def read_lines(path):\n    with open("


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4)     # the course model: real text for the stop strings and deltas


@pytest.fixture(scope="module")
def free_text(llm):
    """The greedy continuation of PROMPT, and the text after each of its tokens."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    ends = [len(llm.tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]
    return out.outputs[0].text, ids, ends


def stream(engine, request_ids):
    """Step until every request is done; every RequestOutput, per request, in order."""
    seen = {r: [] for r in request_ids}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_outputs_every_step_with_deltas_that_join_to_the_text(llm, free_text):
    text, ids, _ = free_text
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    outs = stream(engine, ["a"])["a"]
    assert len(outs) == 40 and [o.finished for o in outs] == [False] * 39 + [True]
    assert "".join(o.outputs[0].text_delta for o in outs) == outs[-1].outputs[0].text == text
    assert outs[-1].outputs[0].token_ids == ids and outs[-1].outputs[0].finish_reason == "length"
    assert all(o.outputs[0].finish_reason is None for o in outs[:-1])
    m = outs[-1].metrics
    assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["last_token_time"] \
        <= m["finished_time"]
    assert len(m["token_times"]) == 40 and m["token_times"] == sorted(m["token_times"]) and m["ttft"] > 0


def test_a_stop_string_across_token_boundaries_ends_the_text_before_it(llm, free_text):
    text, ids, ends = free_text
    # a 4-character stop string starting inside one token and ending in a later one
    k = next(e - 2 for e in ends[3:] if 0 < e - 2 and e - 2 not in ends and e + 2 <= len(text)
             and text[e - 2:e + 2].strip() and text.find(text[e - 2:e + 2]) == e - 2)
    stop = text[k:k + 4]
    last = next(i for i, e in enumerate(ends) if e >= k + 4)          # the token that completes it
    engine = llm.engine
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "@@@@"]))
    outs = stream(engine, ["s"])["s"]
    final = outs[-1].outputs[0]
    assert final.text == text[:k] and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.token_ids == ids[:last + 1]
    assert "".join(o.outputs[0].text_delta for o in outs) == text[:k]
    # nothing of the stop string was ever sent, not even its first characters before it was complete
    sent = ""
    for o in outs:
        sent += o.outputs[0].text_delta
        assert stop[:1] not in sent[k:] and len(sent) <= k
    assert llm.metrics()["kv_blocks_free"] == llm.metrics()["kv_blocks_total"]


def test_stop_strings_through_generate(llm, free_text):
    text, _, _ = free_text
    stop = text[10:13]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=stop), use_tqdm=False)[0]
    assert out.outputs[0].text == text[:text.find(stop)] and out.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=[""])


def test_abort_a_waiting_a_running_and_a_prefix_sharing_request(llm):
    engine = llm.engine
    shared = list(range(100, 164))                              # 4 full blocks of 16 shared by two requests
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("base", shared + [7], params)
    engine.step()                                               # its blocks are computed and cached
    engine.add_request("sharer", shared + [8], params)
    engine.add_request("keep", random_prompts([12])[0], params)
    for i in range(6):
        engine.add_request(f"queued-{i}", random_prompts([20], seed=i)[0], params)  # max_num_seqs=4: some wait
    engine.step()
    sharer = engine.requests["sharer"]
    assert sharer.block_table[:4] == engine.requests["base"].block_table[:4]   # the same blocks, shared
    waiting = next(s for s in engine.scheduler.waiting)
    engine.abort([waiting.seq_id, "sharer", "no-such-request"])
    engine.abort("sharer")                                      # twice: nothing happens
    assert waiting.finish_reason == sharer.finish_reason == "abort" and sharer.finish_time is not None
    assert waiting not in engine.scheduler.waiting and sharer not in engine.scheduler.running
    base_blocks = engine.requests["base"].block_table[:4]
    assert all(engine.block_manager.blocks[b].ref_count == 1 for b in base_blocks)   # the sharer let go
    outs = stream(engine, [r for r in list(engine.requests)])
    assert outs["keep"][-1].outputs[0].finish_reason == "length"
    m = llm.metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["num_running"] == m["num_waiting"] == 0


def test_aborted_neighbours_leave_outputs_unchanged(tmp_path):
    model_dir = save_tiny_model(tmp_path, LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=256))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), max_num_seqs=3)
    engine = llm.engine
    prompts = random_prompts([9, 30, 14, 5], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.step()
    engine.step()
    engine.abort(["1", "3"])                     # one running, one still waiting
    outs = stream(engine, ["0", "2"])
    for i in (0, 2):
        assert outs[str(i)][-1].outputs[0].token_ids == hf_greedy(ref, prompts[i], 12)
    assert llm.metrics()["kv_blocks_free"] == llm.metrics()["kv_blocks_total"]


def test_request_ids_are_checked(llm):
    engine = llm.engine
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'dup' is already running or waiting"):
        engine.add_request("dup", [5, 6], SamplingParams())
    with pytest.raises(TypeError, match="request_id must be a non-empty str"):
        engine.add_request(7, [5, 6], SamplingParams())
    stream(engine, ["dup"])
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))   # finished ids may be reused
    stream(engine, ["dup"])


def test_eos_comes_from_generation_config(tmp_path):
    """generation_config.json's eos_token_id (a list here) stops a request, not only config.json's."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1)
    model_dir = save_tiny_model(tmp_path, cfg)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = random_prompts([8], seed=9)[0]
    free = hf_greedy(ref, prompt, 12)
    eos = free[5]
    assert eos not in free[:5] and eos != 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    out = LLM(str(model_dir)).generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:6] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == eos


def test_a_zero_exponential_draw_cannot_pick_a_filtered_token(monkeypatch):
    """The exponential race divides by the noise: a draw of exactly 0 must not make a filtered token win."""
    logits = torch.tensor([[5.0, 4.0, -1.0, -2.0]])
    real_empty = torch.empty

    def zero_noise(*shape, **kw):                 # every Exp(1) draw comes out as 0
        t = real_empty(*shape, **kw)
        t.exponential_ = lambda generator=None: t.zero_()
        return t
    monkeypatch.setattr(torch, "empty", zero_noise)
    token = sample(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert int(token[0]) in (0, 1)
