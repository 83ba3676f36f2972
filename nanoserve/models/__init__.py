"""Chapter 01: the model. A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) that matches transformers.

    model = models.load(path, device="cpu", dtype=torch.float32)
    logits = model(input_ids)     # [B, T] -> [B, T, vocab]
"""
from nanoserve.models.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import CheckpointError, load

__all__ = ["load", "CausalLM", "ModelConfig", "ConfigError", "CheckpointError", "SUPPORTED_ARCHITECTURES"]
