"""The attention layer: causal attention without a cache (chapter 01), and over the paged KV cache.

    backend      AttentionBackend: the interface the model calls, attend(layer, q, k, v), and who implements it
    functional   causal_mask, causal_attention, prefill_attention, decode_attention: the PyTorch maths
    metadata     AttentionMetadata, StepInputs: one step's positions, cache rows and block tables, built
                 once per step with array ops and shared by every layer; with a Padding target, the same
                 step at a static shape (chapter 06)
    paged        PagedKVCache (the block pool's tensors) and PagedAttention (store k/v, attend through
                 the block tables with one backend's kernels)

Imports go one way: engine -> models -> attention -> kernels. The engine owns the cache and builds each
step's metadata; it hands both down inside a PagedAttention; the model calls `attend` on the
AttentionBackend it is given. This package imports neither the engine nor the model.
"""
from nanoserve.attention.backend import AttentionBackend
from nanoserve.attention.functional import causal_attention, causal_mask, decode_attention, prefill_attention
from nanoserve.attention.metadata import AttentionMetadata, Padding, StepInputs
from nanoserve.attention.paged import PagedAttention, PagedKVCache, kv_bytes_per_token, split_by_length

__all__ = ["AttentionBackend", "causal_mask", "causal_attention", "prefill_attention", "decode_attention", "AttentionMetadata",
           "Padding", "StepInputs", "PagedKVCache", "PagedAttention", "kv_bytes_per_token", "split_by_length"]
