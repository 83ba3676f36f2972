"""Real-shape models with seeded random weights: a published config, no checkpoint, nothing downloaded.

    model = models.random_model("qwen2.5-0.5b", dtype=torch.bfloat16, device="cuda")
    models.save_random_model("smollm2-135m", "/tmp/smollm2")   # config.json, model.safetensors, tokenizer.json
    LLM(model="/tmp/smollm2").generate([[1, 2, 3]], ...)        # token ids, or text such as "<1> <2> <3>"

A step's time depends on the shapes and the dtype, not on what the weights say, so these models carry
the lessons about memory traffic that the 5.4M-parameter course model (which fits in a CPU's cache) cannot.
The weights are drawn on the CPU in float32 from one seeded generator, in parameter order, then cast
and moved: the same seed gives the same model on every device, up to the dtype's rounding.
"""
from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import install_weights, resolve_dtype
from nanoserve.models.shipped import config_path, real_shape_configs
from nanoserve.device import device as resolve_device

INIT_STD = 0.02   # transformers' default initializer_range: keeps activations in a realistic range


def config_file(name_or_config_path) -> Path:
    """The config.json a shipped name ("qwen2.5-0.5b"), a config.json path or a model directory stands for."""
    if isinstance(name_or_config_path, str) and name_or_config_path in real_shape_configs():
        return config_path(name_or_config_path)
    path = Path(name_or_config_path)
    if not path.exists():
        raise ValueError(f"{str(name_or_config_path)!r} is neither a shipped config "
                         f"({', '.join(real_shape_configs())}) nor a config.json or model directory on disk")
    return path / "config.json" if path.is_dir() else path


def resolve_config(name_or_config_path) -> ModelConfig:
    """A ModelConfig from a ModelConfig, a shipped name, a config.json path or a model directory."""
    if isinstance(name_or_config_path, ModelConfig):
        return name_or_config_path
    return ModelConfig.from_path(config_file(name_or_config_path))


def _draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Matrices (projections, embedding) ~ N(0, INIT_STD); norm weights 1; biases 0."""
    if len(shape) >= 2:
        return torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
    return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)


def random_model(name_or_config_path, dtype=torch.float32, device="cpu", seed: int = 0) -> CausalLM:
    """A CausalLM of the named shape with seeded random weights, in eval mode.

    name_or_config_path: a name from `real_shape_configs()`, a config.json path, a model directory, or a
    ModelConfig. dtype and device as `models.load` takes them. Built on the meta device and filled
    tensor by tensor, so no time is spent on PyTorch's default initialisation.
    """
    cfg = resolve_config(name_or_config_path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with torch.device("meta"):
        model = CausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    state = {name: _draw(name, p.shape, gen).to(device=dev, dtype=dt)
             for name, p in model.named_parameters()}   # a tied head appears once, as the embedding
    return install_weights(model, state)


def placeholder_tokenizer(vocab_size: int):
    """A tokenizer for random weights (the public vocabularies are not shipped): token i is the word "<i>",
    words are split on whitespace, and a word outside the vocabulary is an error."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def save_random_model(name_or_config_path, directory, dtype=torch.float32, seed: int = 0) -> Path:
    """Write a model directory that `LLM(model=directory)` and transformers can load: the config.json as
    given (the published one for a shipped name), model.safetensors with `random_model`'s weights, and
    tokenizer.json, a `placeholder_tokenizer` of the config's vocabulary size. Returns the directory.
    """
    from safetensors.torch import save_file

    source = config_file(name_or_config_path)
    cfg = ModelConfig.from_path(source)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(source.read_text())
    model = random_model(cfg, dtype=dtype, device="cpu", seed=seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}   # tied: the embedding is the head
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    placeholder_tokenizer(cfg.vocab_size).save(str(directory / "tokenizer.json"))
    return directory
