"""Chapter 01: the model. A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) that matches transformers.

    model = models.load(path, device="cpu", dtype=torch.float32)
    logits = model(input_ids)     # [B, T] -> [B, T, vocab]
    model = models.random_model("qwen2.5-0.5b")   # a published config's shape, seeded random weights
"""
from nanoserve.models.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import CheckpointError, load
from nanoserve.models.random_weights import random_model, save_random_model
from nanoserve.models.shipped import real_shape_configs

__all__ = ["load", "CausalLM", "ModelConfig", "ConfigError", "CheckpointError", "SUPPORTED_ARCHITECTURES",
           "random_model", "save_random_model", "real_shape_configs"]
