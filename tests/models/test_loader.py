"""Loading checkpoints: sharded or not, straight to dtype; every bad input named in one clear error."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from nanoserve import models

CFG = Qwen2Config(vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CFG).save_pretrained(tmp_path)
    return tmp_path


def rewrite(ckpt, fn):
    """Apply fn to the checkpoint's tensor dict and save it back."""
    state = load_file(ckpt / "model.safetensors")
    fn(state)
    save_file(state, ckpt / "model.safetensors")


def test_sharded_checkpoint_loads_like_single_file(ckpt, tmp_path_factory):
    sharded = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(CFG)
    ref.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(models.load(sharded)(ids), models.load(ckpt)(ids))


def test_loads_straight_to_dtype(ckpt):
    model = models.load(ckpt, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not model.training


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(models.ConfigError, match="no config.json"):
        models.load(ckpt)


def test_missing_weights_and_pickles_refused(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(models.CheckpointError, match=r"no \*\.safetensors.*pytorch_model\.bin.*pickled"):
        models.load(ckpt)


def test_unsupported_architecture_is_named_with_the_supported_list(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(models.ConfigError, match=r"'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        models.load(ckpt)


def test_unsupported_rope_scaling(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(models.ConfigError, match="'yarn' is not supported"):
        models.load(ckpt)


def test_missing_tensor_is_named(ckpt):
    rewrite(ckpt, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(models.CheckpointError, match=r"missing tensor\(s\) 'model.layers.1.mlp.up_proj.weight'.*\[48, 32\]"):
        models.load(ckpt)


def test_unexpected_tensor_is_named_with_its_file(ckpt):
    rewrite(ckpt, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(models.CheckpointError, match=r"model\.safetensors: unexpected tensor 'model.layers.0.extra.weight'"):
        models.load(ckpt)


def test_misshaped_tensor_names_both_shapes(ckpt):
    rewrite(ckpt, lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    with pytest.raises(models.CheckpointError,
                       match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[8, 32\], the config implies \[16, 32\]"):
        models.load(ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_truncated_file(ckpt, keep):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(models.CheckpointError, match=r"cannot read .*model\.safetensors.*truncated or corrupt"):
        models.load(ckpt)


def test_shard_index_pointing_at_missing_file(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(models.CheckpointError, match="model-00002-of-00002.safetensors"):
        models.load(ckpt)


def test_bad_dtype_and_device(ckpt):
    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        models.load(ckpt, dtype="float8")
    with pytest.raises(ValueError, match="device 'tpu' is not supported"):
        models.load(ckpt, device="tpu")


def test_tied_checkpoint_that_also_saves_the_head_loads(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    rewrite(tmp_path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    model = models.load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
