"""Log-probabilities (vLLM's SamplingParams.logprobs and prompt_logprobs): exactly the log-softmax of the model's
logits from one plain forward of the same tokens, however the engine computed them (prompt in chunks, a shared
prefix in the cache, a sequence preempted and recomputed)."""
import pytest
import torch

from nanoserve import COURSE_MODEL, LLM, SamplingParams
from nanoserve.validation import FieldError

PROMPTS = ["def fibonacci(n):\n    " * 5, "def fibonacci(n):\n    " * 5 + "return", "import os\nimport sys\n" * 4]


def reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return llm.model(torch.tensor([ids]))[0].float().log_softmax(-1)


def check_against_forward(llm: LLM, out, k: int, prompt_k: int) -> int:
    """Every logprob of `out` against a plain forward; returns how many positions were checked. The reference is
    computed for all positions at once (a few tensor ops, not a few per position)."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    ref, P = reference(llm, ids), len(out.prompt_token_ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == P and out.prompt_logprobs[0] is None
    assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    tops = [prompt_k] * (P - 1) + [k] * len(out.outputs[0].logprobs)
    targets = torch.tensor(ids[1:])
    rows = ref[:-1]                                        # row j - 1 predicts token j
    chosen = rows.gather(1, targets[:, None])[:, 0]
    ranks = ((rows > chosen[:, None]).sum(-1) + 1).tolist()
    best = rows.topk(max(k, prompt_k, 1), dim=-1)
    values, indices, chosen = best.values.tolist(), best.indices.tolist(), chosen.tolist()
    for j, (entry, top) in enumerate(zip(entries, tops)):
        token = ids[j + 1]
        assert next(iter(entry)) == token, "the position's own token comes first"
        assert abs(entry[token].logprob - chosen[j]) < 1e-4 and entry[token].rank == ranks[j], (j, entry[token])
        for r in range(top):
            assert abs(entry[indices[j][r]].logprob - values[j][r]) < 1e-4 and entry[indices[j][r]].rank == r + 1
        assert len(entry) <= top + 1
    return len(entries)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Hundreds of small steps: beside another test process on 2 cores, a team of two threads waits on itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    # a 16-token budget: every prompt is prefilled in chunks; 12 blocks of 16: the three requests preempt each other
    return LLM(COURSE_MODEL, device="cpu", max_num_batched_tokens=16, num_kv_blocks=12, max_num_seqs=3)


def test_logprobs_equal_a_plain_forward_through_chunks_cache_hits_and_preemption(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    before = llm.metrics()
    outs = llm.generate(PROMPTS, [greedy, sampled, greedy], use_tqdm=False)
    after = llm.metrics()
    assert after["num_preemptions"] > before["num_preemptions"], "the scenario must preempt a sequence"
    assert sum(check_against_forward(llm, o, k, pk) for o, k, pk in zip(outs, (3, 0, 3), (2, 0, 2))) > 200
    # greedy: each generated token was the most likely one
    assert all(e[t].rank == 1 for o in (outs[0], outs[2]) for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids))
    # the same prompt again, its blocks in the cache: its prompt logprobs are computed all the same
    again = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0]
    assert check_against_forward(llm, again, 3, 2) == len(again.prompt_token_ids) - 1 + 40
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids   # asking for logprobs changes no token


def test_prompt_logprobs_skip_the_cache_and_other_requests_still_hit_it():
    llm = LLM(COURSE_MODEL, device="cpu")
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.metrics()["prefix_cache_hit_tokens"]
    scored = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert llm.metrics()["prefix_cache_hit_tokens"] == hits                  # computed, not read from the cache
    ids = scored.prompt_token_ids
    ref = reference(llm, ids)
    assert len(scored.prompt_logprobs) == len(ids) and scored.prompt_logprobs[0] is None
    assert max(abs(e[t].logprob - ref[j - 1, t].item()) for j, (e, t) in enumerate(zip(scored.prompt_logprobs, ids))
               if j) < 1e-4
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.metrics()["prefix_cache_hit_tokens"] > hits                   # a plain request still hits


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("prompt_logprobs", 1.5)])
def test_a_bad_logprobs_count_names_its_field(field, value):
    with pytest.raises(FieldError, match=rf"SamplingParams\.{field} = .*expected an int in \[0, 20\]"):
        SamplingParams(**{field: value})


def test_logprobs_with_speculative_decoding_is_refused_alone():
    llm = LLM(COURSE_MODEL, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    outs = llm.generate(["def f(", "def g("], [SamplingParams(max_tokens=4, logprobs=1), SamplingParams(max_tokens=4)],
                        use_tqdm=False)
    assert outs[0].error and "speculative decoding" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
