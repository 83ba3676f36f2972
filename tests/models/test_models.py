"""Chapter 01: the decoder matches transformers, for every family and the awkward parts of each."""
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from nanoserve import models

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CONFIGS = {
    # GQA 3:1, tied embeddings, odd vocab
    "llama-gqa-tied": LlamaConfig(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    # head_dim not hidden/heads, biases everywhere, llama3 rope scaling active at these positions
    "llama3-rope-bias": LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=150, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=24, attention_bias=True,
                                    mlp_bias=True, max_position_embeddings=512, rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope": LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                     num_attention_heads=3, num_key_value_heads=1, rope_parameters={
                                         "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "qwen2-bias-gqa4": Qwen2Config(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-tied-mha": Qwen2Config(vocab_size=130, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                                  num_attention_heads=5, num_key_value_heads=5, tie_word_embeddings=True),
    "qwen3-qknorm": Qwen3Config(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "qwen3-bias-mqa": Qwen3Config(vocab_size=150, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=1, head_dim=16, attention_bias=True),
    "mistral-window": MistralConfig(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, sliding_window=5),
    "mistral-headdim": MistralConfig(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None),
}


def build_pair(hf_cfg, tmp_path, dtype=torch.float32):
    """A random-weight transformers model, saved and loaded back by nanoserve."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    ref.save_pretrained(tmp_path)
    return ref, models.load(tmp_path, device="cpu", dtype=dtype)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_fp32(name, tmp_path):
    ref, model = build_pair(CONFIGS[name], tmp_path)
    ids = torch.randint(0, CONFIGS[name].vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ref(ids).logits, model(ids)
    assert got.shape == (2, 37, CONFIGS[name].vocab_size)
    assert expected.std() > 0.05  # a degenerate (all-zero) model would match anything
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["llama3-rope-bias", "qwen3-qknorm", "qwen2-bias-gqa4"])
def test_logits_match_transformers_bf16(name, tmp_path):
    # bf16 has 8 bits of mantissa; the two implementations round in the same places, so they agree far
    # tighter than bf16's precision, but SDPA kernels may sum in another order: allow a few ulps at |logit|~1.
    ref, model = build_pair(CONFIGS[name], tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(0, CONFIGS[name].vocab_size, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = ref(ids).logits.float(), model(ids).float()
    assert got.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    assert (got - expected).abs().max().item() <= 2e-2


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen3-qknorm", "mistral-window"])
def test_greedy_continuation_matches_transformers(name, tmp_path):
    ref, model = build_pair(CONFIGS[name], tmp_path)
    prompt = torch.randint(0, CONFIGS[name].vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)[0, 7:].tolist()
    ids = prompt
    with torch.no_grad():
        for _ in range(12):  # the naive loop: recompute the whole sequence each token
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, 7:].tolist() == expected


def test_sliding_window_changes_attention(tmp_path):
    _, model = build_pair(CONFIGS["mistral-window"], tmp_path)
    unwindowed = models.CausalLM(dataclasses.replace(model.config, sliding_window=None))
    unwindowed.load_state_dict(model.state_dict())
    ids = torch.randint(0, 150, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = model(ids), unwindowed(ids)
    assert torch.equal(a[:, :5], b[:, :5])          # inside the window: identical
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3  # beyond it: the window matters


def test_parameter_count_formula(tmp_path):
    for name in ["llama3-rope-bias", "qwen2-bias-gqa4", "qwen3-bias-mqa", "llama-gqa-tied"]:
        ref, model = build_pair(CONFIGS[name], tmp_path / name)
        assert model.config.num_parameters == sum(p.numel() for p in model.parameters()) == ref.num_parameters()


def test_input_must_be_2d(tmp_path):
    _, model = build_pair(CONFIGS["qwen2-tied-mha"], tmp_path)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        model(torch.zeros(5, dtype=torch.long))
