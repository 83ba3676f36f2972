"""Real-shape models: the shipped public configs parse to their published sizes, random weights are
seeded, and a saved random model runs through LLM and loads in transformers."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams, models
from nanoserve.models.shipped import config_path

# parameters as each model's publisher states them (tied embeddings counted once)
PUBLISHED_PARAMETERS = {"qwen2.5-0.5b": 0.49e9, "llama-3.2-1b": 1.24e9, "smollm2-135m": 135e6}

TINY_QWEN2 = {  # biases on q/k/v, untied head, GQA 2:1
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "use_sliding_window": False, "eos_token_id": 1}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return path


def test_the_shipped_configs():
    assert models.real_shape_configs() == ["llama-3.2-1b", "qwen2.5-0.5b", "smollm2-135m"]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_config_parses_to_the_published_size(name):
    cfg = models.ModelConfig.from_path(config_path(name))
    with torch.device("meta"):   # the real module tree, no memory
        built = sum(p.numel() for p in models.CausalLM(cfg).parameters())
    assert built == cfg.num_parameters
    assert abs(built / PUBLISHED_PARAMETERS[name] - 1) < 0.02, f"{name}: {built:,} parameters"
    assert cfg.tie_word_embeddings


def test_the_shapes_lessons_rely_on():
    qwen = models.ModelConfig.from_path(config_path("qwen2.5-0.5b"))
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim, qwen.vocab_size) == (896, 24, 14, 2, 64, 151936)
    assert qwen.qkv_bias and qwen.sliding_window is None and qwen.rope_theta == 1e6
    llama = models.ModelConfig.from_path(config_path("llama-3.2-1b"))
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads, llama.head_dim) == (2048, 16, 8, 64)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 32.0
    smol = models.ModelConfig.from_path(config_path("smollm2-135m"))
    assert (smol.hidden_size, smol.num_hidden_layers, smol.num_attention_heads, smol.num_key_value_heads) == (576, 30, 9, 3)


def test_random_weights_are_seeded(tiny_config):
    a, b = models.random_model(tiny_config, seed=0), models.random_model(tiny_config, seed=0)
    other = models.random_model(tiny_config, seed=1)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), other.parameters()):
        assert torch.equal(p, q), name
        if name.endswith("proj.weight"):
            assert not torch.equal(p, r), name
    params = dict(a.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1) and torch.all(params["model.layers.0.self_attn.q_proj.bias"] == 0)
    assert abs(params["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002


def test_random_model_in_bfloat16_matches_float32_rounded(tiny_config):
    full = models.random_model(tiny_config)
    half = models.random_model(tiny_config, dtype=torch.bfloat16)
    for p, h in zip(full.parameters(), half.parameters()):
        assert h.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), h)


def test_a_real_shape_model_runs():
    model = models.random_model("smollm2-135m")
    assert model.lm_head.weight is model.model.embed_tokens.weight   # tied, as published
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters
    assert model(torch.tensor([[1, 2, 3, 4]])).shape == (1, 4, 49152)


def test_unknown_model_names_the_shipped_ones():
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        models.random_model("qwen2.5-7b")


def test_a_saved_random_model_runs_in_llm_and_transformers(tiny_config, tmp_path):
    directory = models.save_random_model(tiny_config, tmp_path / "tiny")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    llm = LLM(model=str(directory), device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0]
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert out.token_ids == expected
    # the placeholder tokenizer: token i is the word "<i>"
    text = llm.generate("<5> <6> <7> <8>", greedy, use_tqdm=False)[0]
    assert text.prompt_token_ids == [5, 6, 7, 8] and text.outputs[0].token_ids == expected
    assert text.outputs[0].text == " ".join(f"<{i}>" for i in expected)
