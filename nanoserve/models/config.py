"""The model's shape, read from a Hugging Face `config.json`.

One dataclass covers the decoder families we serve; the family only decides a few switches
(biases on q/k/v, RMSNorm on q and k). Anything we do not implement is refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture in config.json -> its switches; "attention_bias" means: read that field of the config.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model we do not support."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None        # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                  # bias on q/k/v projections (always in Qwen2)
    o_bias: bool = False                    # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False                   # RMSNorm over head_dim on q and k before rotary (Qwen3)
    sliding_window: int | None = None       # attend only to the last `sliding_window` keys
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def num_parameters(self) -> int:
        """Parameters of the model this config builds (the lm_head counted once when tied)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key):
            if key not in cfg:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers 5 writes rope settings as `rope_parameters`; older configs use rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = rope or cfg.get("rope_scaling") or None
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            rope_scaling["rope_type"] = rope_type
            if rope_type == "default":
                rope_scaling = None
        switch = {k: bool(cfg.get(v, False)) if isinstance(v, str) else v for k, v in family.items()}
        sliding = cfg.get("sliding_window")
        if arch.startswith("Qwen"):
            if cfg.get("use_sliding_window", False):
                raise ConfigError(f"{source}: Qwen's per-layer sliding window (use_sliding_window=true) is not supported")
            sliding = None  # Qwen configs carry a window size but only use it when asked
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=switch["qkv_bias"],
            o_bias=switch["o_bias"],
            mlp_bias=switch["mlp_bias"],
            qk_norm=switch["qk_norm"],
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """Read `<path>/config.json` (or a config.json file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no config.json in {path}: a model directory needs config.json and *.safetensors")
        try:
            cfg = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(cfg, source=str(file))
