"""Chapter 02: sampling parameters are validated by name, and each strategy draws from the right set."""
import pytest
import torch

from nanoserve.sampling import SamplingParams, filter_logits, probs, sample


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
    ("max_tokens", 0), ("max_tokens", 3.0), ("seed", "x"), ("seed", 2**64), ("seed", -2**63 - 1), ("stop_token_ids", [1, -1]),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = "):
        SamplingParams(**{field: value})


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos, p.stop_token_ids, p.seed) == \
        (1.0, 1.0, -1, 16, False, None, None)


def logits(b=4, v=50, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    assert torch.equal(sample(x, [SamplingParams(temperature=0)] * 4), x.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(temperature=1e-4)])
def test_degenerate_settings_reduce_to_greedy(params):
    x = logits(b=8)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample(x, [params] * 8, default_generator=g), x.argmax(-1))


def test_filter_keeps_top_k_and_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(x, torch.tensor([2, -1]), torch.tensor([1.0, 0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False],   # top_k=2
                             [True, True, False, False]]   # top_p=0.7: 0.5 alone < 0.7, 0.5+0.3 reaches it


def test_top_k_alone_keeps_k_tokens_even_when_one_dominates():
    # top_p = 1 must keep the tail: an fp32 cumsum reaches 1.0 after the dominant token
    x = torch.tensor([[20.0, 0, 0, 0, 0, 0]])
    kept = filter_logits(x, torch.tensor([5]), torch.tensor([1.0])).isfinite()
    assert kept.sum().item() == 5


def test_sampling_matches_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 20000
    x = probs.log().expand(n, 4).contiguous()
    draws = sample(x, [SamplingParams(temperature=1.0)] * n, default_generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.015  # ~4 standard errors at n=20000


def test_top_k_draws_only_from_the_top_k():
    x = logits(b=1, v=100).expand(2000, 100).contiguous()
    draws = sample(x, [SamplingParams(top_k=3)] * 2000, default_generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == set(x[0].topk(3).indices.tolist())


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    x = logits(b=3)
    p = [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=9)]
    a = sample(x, p, [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(9)],
               torch.Generator().manual_seed(0))
    alone = sample(x[:1], p[:1], [torch.Generator().manual_seed(7)])
    assert a[0] == alone[0]
    other = sample(x, p, [torch.Generator().manual_seed(8), None, torch.Generator().manual_seed(9)],
                   torch.Generator().manual_seed(0))
    assert other[2] == a[2]


def test_rows_and_params_must_agree():
    with pytest.raises(ValueError, match="3 rows of logits but 2 SamplingParams"):
        sample(logits(b=3), [SamplingParams()] * 2)


def test_probs_is_the_distribution_sample_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.1, 3.0, 0.2, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0, top_k=2)]
    p = probs(logits, rows)
    assert torch.allclose(p[0], (logits[0] / 0.5).softmax(-1))
    assert p[1].tolist() == [0.0, 1.0, 0.0, 0.0]                       # greedy: a point mass on the argmax
    assert (p[2] > 0).sum() == 2 and torch.allclose(p[2].sum(), torch.tensor(1.0))
    assert torch.equal(probs(logits[:1], rows[0]), p[:1])             # one SamplingParams for every row
    # the sampler draws from exactly these: rows with top-k 2 never leave its two tokens
    gen = torch.Generator().manual_seed(0)
    drawn = [int(sample(logits[2:], rows[2:], default_generator=gen)[0]) for _ in range(200)]
    assert set(drawn) == {i for i in range(4) if p[2, i] > 0}
    with pytest.raises(ValueError, match="3 rows of logits but 2 SamplingParams"):
        probs(logits, rows[:2])
