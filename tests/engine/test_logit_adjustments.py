"""What a request may do to the logits before a token is drawn (vLLM's and OpenAI's fields): logit_bias,
min_tokens, the presence, frequency and repetition penalties, and min_p."""
import math

import pytest
import torch

from nanoserve import COURSE_MODEL, LLM, SamplingParams
from nanoserve.sampling import LogitState, adjust_logits, adjust_logits_batched
from nanoserve.validation import FieldError

PROMPT = "def fibonacci(n):\n    "


def test_adjust_logits_applies_each_rule_in_vllms_order():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0, 0.0], [1.0, -1.0, 2.0, 0.5, 3.0, 0.0]])
    p = SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       logit_bias={5: 3}, min_tokens=5)
    out = adjust_logits(logits, [p, SamplingParams()], [[0, 1], [0, 1]], [[2, 2, 3], [2, 2, 3]], [{4}, {4}])
    # bias: 5 gets +3; min_tokens (3 of 5 out): stop token 4 banned; repetition on {0, 1, 2, 3}: / 2 if > 0 else x 2;
    # then token 2 (twice) -0.25 x 2 - 0.5 and token 3 (once) -0.25 - 0.5
    assert out[0].tolist() == [0.5, -2.0, 0.0, -0.5, -math.inf, 3.0]
    assert out[1].tolist() == logits[1].tolist()               # a row that asked for nothing is untouched
    assert logits[0, 4] == 3.0                                 # the raw logits are kept (logprobs read them)


def test_the_batched_adjustment_equals_the_per_row_reference_step_after_step():
    """The engine's path (each sequence's rows kept and brought up to date) against the reference that rebuilds
    each row from its token lists: equal to the bit, over steps, on a batch mixing every rule and none."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 300, 7
    rand = lambda hi, n: torch.randint(0, hi, (n,), generator=gen).tolist()
    params = [SamplingParams(max_tokens=50, repetition_penalty=r, frequency_penalty=f, presence_penalty=pr,
                             min_tokens=m, logit_bias=b)
              for r, f, pr, m, b in [(1.0, 0.0, 0.0, 0, None), (1.3, 0.0, 0.0, 0, None), (0.8, 0.5, -0.2, 3, None),
                                     (1.0, 0.4, 0.4, 0, {3: 2.5, 299: -100, 7: 0.5}), (1.1, 0.1, 0.0, 6, {0: 1.0}),
                                     (1.0, 0.0, 0.0, 4, None), (2.0, 1.0, 1.0, 0, {5: -1.0})]]
    prompts = [rand(vocab, n) for n in (1, 5, 40, 12, 3, 8, 20)]
    stops = [{0, 1}] * rows
    for batch in ([0, 1, 2, 3, 4, 5, 6], [0, 1], [0, 3], [5, 0], [2]):   # every rule, or only some (the rest skipped)
        states = [LogitState(params[i], prompts[i], stops[i], vocab, "cpu") for i in batch]
        outputs = [[] for _ in batch]
        for step in range(8):
            logits = torch.randn(len(batch), vocab, generator=gen) * 4
            for out, state in zip(outputs, states):
                state.catch_up(out)
            expected = adjust_logits(logits, [params[i] for i in batch], [prompts[i] for i in batch], outputs,
                                     [stops[i] for i in batch])
            got = adjust_logits_batched(logits, [params[i] for i in batch], states, [len(o) for o in outputs])
            assert torch.equal(got, expected) and got is not logits, (batch, step)
            for out in outputs:
                out.extend(rand(vocab, 1 + step % 2))      # one token a step, or two (a speculative step's accepted)


@pytest.fixture(scope="module")
def llm():
    return LLM(COURSE_MODEL, device="cpu")


def greedy(llm, prompt=PROMPT, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, **{"max_tokens": 24, **kw}), use_tqdm=False)[0].outputs[0]


def test_penalties_in_a_mixed_batch_give_each_request_its_tokens_alone(llm):
    """Each row's adjustments are its own: a request's greedy tokens are the same run alone and in a batch whose
    neighbours ask for other penalties, biases, or none."""
    asks = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.4), {},
            dict(logit_bias={11: 4.0}, min_tokens=10), dict(repetition_penalty=0.9, frequency_penalty=0.2)]
    prompts = [PROMPT, "import os\n", "class A:\n    def", "# the sum of\n", "for i in range("]
    together = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=20, **kw) for kw in asks], use_tqdm=False)
    for prompt, kw, out in zip(prompts, asks, together):
        assert out.outputs[0].token_ids == greedy(llm, prompt, max_tokens=20, **kw).token_ids, kw


def test_logit_bias_forces_and_forbids_tokens(llm):
    assert greedy(llm, max_tokens=6, logit_bias={123: 100}).token_ids == [123] * 6
    base = greedy(llm)
    banned = greedy(llm, logit_bias={base.token_ids[0]: -100})
    assert banned.token_ids[0] != base.token_ids[0] and base.token_ids[0] not in banned.token_ids


def test_min_tokens_hold_back_stop_tokens_and_stop_strings(llm):
    base = greedy(llm, max_tokens=16)
    stop_id = base.token_ids[2]
    assert greedy(llm, max_tokens=16, stop_token_ids=[stop_id]).token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]
    held = greedy(llm, max_tokens=16, stop_token_ids=[stop_id], min_tokens=8)
    assert stop_id not in held.token_ids[:8] and len(held.token_ids) >= 8
    early = base.text[:12].strip()[-3:]                       # a string the greedy text holds early on
    assert greedy(llm, max_tokens=16, stop=[early]).text.find(early) == -1
    late = greedy(llm, max_tokens=16, stop=[early], min_tokens=12)
    assert len(late.token_ids) >= 12


def test_penalties_make_greedy_text_repeat_less(llm):
    base = greedy(llm)
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=1.8)):
        out = greedy(llm, **kw)
        assert len(set(out.token_ids)) > len(set(base.token_ids)), (kw, out.text)


def test_min_p_one_keeps_only_the_most_likely_token(llm):
    base = greedy(llm, max_tokens=16).token_ids
    outs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=16, min_p=1.0) for s in (1, 2)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [base, base]


def test_a_bias_outside_the_vocabulary_fails_that_request_alone(llm):
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2, logit_bias={10**6: 1}), SamplingParams(max_tokens=2)],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "logit_bias" in outs[0].error
    assert outs[1].error is None


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                         ("repetition_penalty", math.inf), ("min_p", 1.5), ("logit_bias", {1: 101}),
                                         ("logit_bias", {"a": 1}), ("logit_bias", [1]), ("min_tokens", 17),
                                         ("min_tokens", -1)])
def test_a_bad_value_names_its_field(field, value):
    with pytest.raises(FieldError, match=rf"SamplingParams\.{field} = "):
        SamplingParams(max_tokens=16, **{field: value})
