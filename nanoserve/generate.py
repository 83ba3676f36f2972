"""Chapter 02: one sequence, two ways. Recompute everything per token, or keep a KV cache.

These are the loops the chapter times against each other; the engine (chapter 03) runs the cached
one for many sequences at once.
"""
from __future__ import annotations

import torch

from nanoserve.kv_cache import KVCache
from nanoserve.models import CausalLM
from nanoserve.sampling import SamplingParams, sample


@torch.inference_mode()
def generate_naive(model: CausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy, no cache: every new token runs the whole sequence again (cost grows with length squared)."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=dev)
    for _ in range(max_new_tokens):
        next_id = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def generate_cached(model: CausalLM, prompt_ids: list[int], max_new_tokens: int,
                    params: SamplingParams | None = None, kv_cache: KVCache | None = None) -> list[int]:
    """Prefill the prompt once, then decode one token per step reading earlier keys/values from the cache."""
    params = params or SamplingParams(temperature=0.0)
    p = next(model.parameters())
    cache = kv_cache or KVCache(model.config, 1, len(prompt_ids) + max_new_tokens, p.device, p.dtype)
    gen = torch.Generator(p.device).manual_seed(params.seed) if params.seed is not None else None
    out: list[int] = []
    new, start = list(prompt_ids), 0
    for _ in range(max_new_tokens):
        cache.prepare([0], [start], [len(new)])
        positions = torch.arange(start, start + len(new), device=p.device)[None]
        hidden = model.hidden_states(torch.tensor([new], device=p.device), positions, cache)
        logits = model.lm_head(hidden[:, -1]).float()
        token = int(sample(logits, [params], [gen])[0])
        out.append(token)
        start, new = start + len(new), [token]
    return out
