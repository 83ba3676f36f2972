"""The one seam between the model and whatever holds its keys and values: `AttentionBackend`.

A decoder layer computes q, k, v for the step's tokens and hands them to `attend(layer, q, k, v)`,
which stores this step's k/v where the backend keeps them and returns the attention output. Which
tokens belong to which sequence, and where each one's keys live, the backend knows already: it was
given the step's description before the forward (its metadata). The model never looks inside.

The backends, one per chapter that changes where keys live or how a step runs:

    kv_cache.KVCache                           02  one contiguous row of positions per sequence
    attention.PagedAttention                   04  blocks reached through block tables; 05: a kernel set
    engine.compiled_decode.StaticDecodeAttention  06  padded decode steps at static shapes (torch.compile)
    engine.cuda_graphs.InPlaceDecodeAttention  06  the paged kernel over the buffers a CUDA graph replays

Without a backend the model attends causally over the tokens it is given (chapter 01).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the step's k/v of `layer`, then attend. q: [1, N, heads, head_dim]; k, v: [1, N, kv_heads,
        head_dim] (N: the step's tokens, every sequence's flattened in order); returns [1, N, heads, head_dim]."""
        ...
