"""Chapter 02: the cached loop computes exactly what recomputation computes."""
import pytest
import torch

from nanoserve import models
from nanoserve.generate import generate_cached, generate_naive
from nanoserve.kv_cache import KVCache
from nanoserve.models import ModelConfig


def tiny(sliding_window=None, seed=0):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=101, hidden_size=48, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                      sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = models.CausalLM(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


@pytest.mark.parametrize("window", [None, 4])
def test_cached_equals_naive(window):
    model = tiny(window)
    prompt = list(range(3, 14))
    assert generate_cached(model, prompt, 20) == generate_naive(model, prompt, 20)


def test_cached_logits_match_full_forward_with_chunks_and_mixed_batch():
    """Three sequences in one step (a decode, a second prompt chunk, a fresh prompt): logits as without cache."""
    model = tiny()
    cache = KVCache(model.config, num_slots=4, max_len=32)
    seqs = {2: torch.arange(1, 11), 0: torch.arange(20, 37), 3: torch.arange(50, 56)}
    with torch.no_grad():
        full = {s: model(t[None])[0] for s, t in seqs.items()}
        # step 1: slot 2 prefills 9 tokens, slot 0 prefills its first chunk of 10
        cache.prepare([2, 0], [0, 0], [9, 10])
        model(torch.cat([seqs[2][:9], seqs[0][:10]])[None],
              torch.cat([torch.arange(9), torch.arange(10)])[None], cache)
        # step 2: slot 2 decodes its 10th token, slot 0 its second chunk, slot 3 a whole prompt
        cache.prepare([2, 0, 3], [9, 10, 0], [1, 7, 6])
        out = model(torch.cat([seqs[2][9:], seqs[0][10:], seqs[3]])[None],
                    torch.cat([torch.tensor([9]), torch.arange(10, 17), torch.arange(6)])[None], cache)[0]
    assert torch.allclose(out[0], full[2][9], atol=1e-5)
    assert torch.allclose(out[1:8], full[0][10:], atol=1e-5)
    assert torch.allclose(out[8:], full[3], atol=1e-5)


def test_cache_size_formula_and_bounds():
    model = tiny()
    cache = KVCache(model.config, num_slots=3, max_len=10)
    assert KVCache.bytes_per_token(model.config) == 2 * 2 * 2 * 8 * 4
    assert cache.nbytes == 3 * 10 * KVCache.bytes_per_token(model.config)
    with pytest.raises(ValueError, match="needs 12 positions; the cache holds 10"):
        cache.prepare([0], [5], [7])
    with pytest.raises(ValueError, match="slot 3 is outside"):
        cache.prepare([3], [0], [1])
    fresh = KVCache(model.config, 1, 4)
    with pytest.raises(RuntimeError, match="prepare"):
        model(torch.tensor([[1, 2]]), attention=fresh)
