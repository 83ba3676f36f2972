"""Speculative decoding (chapter 10): exact verification, the engine's accounting, the config's errors.

The distribution test runs the verification rule itself on a toy Markov "model" over 4 tokens, many seeded
times, and compares the empirical distribution of the first three tokens with the target's exact one; a
deliberately biased rule (resampling a rejected position from p instead of the residual (p - q)+) must fail
the same bound, so the test can tell right from wrong.
"""
import itertools

import pytest
import torch

from nanoserve import COURSE_DRAFT_MODEL, LLM, SamplingParams
from nanoserve.engine.sequence import Sequence
from nanoserve.speculative import NgramProposer, SpeculativeConfig, probs, verify

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n    ",
           "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n\n"
           "    def get(self, key):\n",
           "for i in range(10):\n    print(i)\nfor j in range(",
           "x = [1, 2, 3]\ny = [4, 5, 6]\nz = [",
           "# sort a list\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": COURSE_DRAFT_MODEL, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(max_num_seqs=8, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("config", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_greedy_equals_plain_greedy_under_mixed_batching_and_preemption(reference, config):
    # 16 blocks of 16 positions for 6 sequences of 52-80 tokens: the pool runs dry, requests are preempted
    # and recomputed, and prefill chunks (budget 64 tokens) share steps with speculative decodes
    llm = LLM(max_num_seqs=6, max_model_len=256, num_kv_blocks=16, max_num_batched_tokens=64,
              speculative_config=config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["num_preemptions"] > 0, "the scenario must preempt"
    assert m["kv_blocks_free"] == m["kv_blocks_total"], "every block is back after rollbacks and preemptions"
    assert 0 < m["spec_decode_num_accepted_tokens"] <= m["spec_decode_num_draft_tokens"]
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == m["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), "position i+1 is accepted only after position i"
    if config is DRAFT:
        proposer = llm.engine.spec.proposer
        assert not proposer.states and proposer.blocks.num_free == proposer.blocks.num_blocks


def test_the_scheduler_reserves_the_drafts_blocks_and_the_decoder_allocates_none():
    # a small pool: some steps cannot reserve all k lookahead slots, and the drafts shrink to what was reserved
    llm = LLM(max_num_seqs=4, max_model_len=128, num_kv_blocks=12, speculative_config=NGRAM)
    engine, calls = llm.engine, {"in_spec": False, "from_spec": 0, "reserved": 0}
    ensure, run = engine.block_manager.ensure, engine.spec.run

    def counting_ensure(seq, n):
        calls["from_spec"] += calls["in_spec"]
        return ensure(seq, n)

    def spec_run(*args):
        calls["in_spec"] = True
        try:
            return run(*args)
        finally:
            calls["in_spec"] = False

    reserve = engine.scheduler.reserve_lookahead
    engine.block_manager.ensure, engine.spec.run = counting_ensure, spec_run
    engine.scheduler.reserve_lookahead = lambda batch: (calls.__setitem__("reserved", calls["reserved"] + 1),
                                                        reserve(batch))
    outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert calls["from_spec"] == 0 and calls["reserved"] > 0
    assert llm.metrics()["spec_decode_num_draft_tokens"] > 0 and all(o.outputs[0].token_ids for o in outs)
    assert llm.metrics()["kv_blocks_free"] == llm.metrics()["kv_blocks_total"]


@pytest.mark.slow
def test_lengths_stops_and_seeds_are_kept():
    llm = LLM(max_num_seqs=4, max_model_len=256, speculative_config=NGRAM)
    plain = LLM(max_num_seqs=4, max_model_len=256)
    exact = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    outs = llm.generate(PROMPTS[:4], exact, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 23 and o.outputs[0].finish_reason == "length" for o in outs)
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop=["\n\n"])
    assert [o.outputs[0].text for o in llm.generate(PROMPTS, stop, use_tqdm=False)] == \
           [o.outputs[0].text for o in plain.generate(PROMPTS, stop, use_tqdm=False)]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7)
    alone = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    in_batch = llm.generate(PROMPTS[:3], [seeded, GREEDY, GREEDY], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == in_batch, "a seeded request draws the same tokens whatever else is in the batch"


def toy_markov(v=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(v, v, generator=g) ** 3 + 0.02
    draft = torch.rand(v, v, generator=g) ** 3 + 0.02        # a different, poorly matched draft
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)


def biased_verify(p, drafts, q, params, generator=None):
    """The classic mistake: on a rejection, resample from p instead of the residual (p - q)+."""
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=generator)) * float(q[i, d]) < float(p[i, d]):
            continue
        return drafts[:i] + [int(torch.multinomial(p[i], 1, generator=generator))], i
    return list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))], len(drafts)


def speculative_samples(rule, target, draft, n_samples, k=2, length=3, start=0):
    """n_samples sequences of `length` tokens from the toy target, generated speculatively with `rule`."""
    g = torch.Generator().manual_seed(1234)
    params = SamplingParams(temperature=1.0)
    counts = {}
    for _ in range(n_samples):
        seq = [start]
        while len(seq) < length + 1:
            drafts, qs = [], []
            for _ in range(k):   # the draft runs ahead from the sequence's last token
                q = draft[(drafts or seq)[-1]]
                drafts.append(int(torch.multinomial(q, 1, generator=g)))
                qs.append(q)
            p = torch.stack([target[t] for t in [seq[-1]] + drafts])   # the target at each proposed position
            tokens, _ = rule(p, drafts, torch.stack(qs), params, g)
            seq += tokens
        key = tuple(seq[1:length + 1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def total_variation(counts, target, length=3, start=0):
    n = sum(counts.values())
    tv = 0.0
    for key in itertools.product(range(target.shape[0]), repeat=length):
        exact, prev = 1.0, start
        for t in key:
            exact, prev = exact * float(target[prev, t]), t
        tv += abs(counts.get(key, 0) / n - exact)
    return tv / 2


def test_rejection_sampling_keeps_the_targets_distribution_and_a_biased_rule_fails():
    target, draft = toy_markov(seed=1)
    n = 6000
    # 64 outcomes: sampling noise alone leaves a TV of 0.02-0.03 at 8000 samples (three toy models); the
    # biased rule measured 0.11-0.22 on them, 0.22 on this one
    correct = total_variation(speculative_samples(verify, target, draft, n), target)
    biased = total_variation(speculative_samples(biased_verify, target, draft, n), target)
    assert correct < 0.07, correct
    assert biased > 0.15, biased


def test_greedy_verification_accepts_the_matching_prefix():
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 2, 0]), 5).float()   # target argmaxes 3, 1, 2, then 0
    params = SamplingParams(temperature=0.0)
    assert verify(p, [3, 1, 2], None, params) == ([3, 1, 2, 0], 3)           # all accepted, the bonus
    assert verify(p, [3, 4, 2], None, params) == ([3, 1], 1)                 # first mismatch replaced
    assert verify(p, [0, 1, 2], None, params) == ([3], 0)
    greedy_probs = probs(torch.tensor([[0.1, 2.0, -1.0]]), params)
    assert greedy_probs.tolist() == [[0.0, 1.0, 0.0]]


def test_a_point_mass_proposal_is_accepted_with_the_targets_probability():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    first = [verify(p, [1], None, params, g)[0][0] for _ in range(4000)]
    freq = [first.count(t) / len(first) for t in range(3)]
    assert all(abs(f - e) < 0.03 for f, e in zip(freq, [0.5, 0.3, 0.2])), freq


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(k=3, n_min=1, n_max=3)
    seq = Sequence("a", [5, 6, 7, 8, 9, 1, 5, 6, 7], SamplingParams())
    assert proposer.propose([seq], [3])[0] == [[8, 9, 1]]
    assert proposer.propose([seq], [1])[0] == [[8]]
    assert proposer.propose([Sequence("b", [1, 2, 3], SamplingParams())], [3])[0] == [[]]


@pytest.mark.parametrize("config,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown"),
    ("ngram", "expected a dict"),
])
def test_bad_speculative_configs_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(config)
