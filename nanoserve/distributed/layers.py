"""Chapter 08: the layers that talk. Everything else in a sharded model is an ordinary layer on fewer heads.

`RowParallelLinear` (o_proj, down_proj) all-reduces its partial sums; `VocabParallelEmbedding` looks up
the ids in its vocabulary rows and all-reduces (each id is found on exactly one rank); `VocabParallelHead`
computes its rows' logits and all-gathers them. Per decode step and layer: two all-reduces of
[tokens, hidden], plus one for the embedding and one all-gather for the head.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input's columns are split, the output is whole."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias   # once, after the sum: not once per rank


class VocabParallelEmbedding(nn.Module):
    """An embedding over rows [start, start + rows) of the vocabulary; other ids contribute zeros."""

    def __init__(self, rows: int, dim: int, start: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[..., None], 0)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary rows, all-gathered into the full [.., vocab] (padding cut)."""

    def __init__(self, rows: int, dim: int, vocab_size: int, world_size: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.vocab_size, self.world_size, self.group = vocab_size, world_size, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]
