"""Shared by the engine tests: a tiny random transformers model on disk, and its greedy reference."""
from __future__ import annotations

import shutil

import torch
from transformers import AutoModelForCausalLM

from nanoserve import COURSE_MODEL

VOCAB = 4096  # the course tokenizer's, so text prompts work too


def save_tiny_model(directory, config) -> str:
    """Save a seeded random model of `config` with the course tokenizer beside it; returns the directory."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    shutil.copy(f"{COURSE_MODEL}/tokenizer.json", directory)
    return directory


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of one prompt (attention mask given: token 0 is not padding)."""
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in lengths]
