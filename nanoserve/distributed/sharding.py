"""Chapter 08: which slice of every weight a tensor-parallel rank holds (Megatron-style).

Column-parallel (output rows split): q/k/v and gate/up. Each rank computes its own heads and its own
slice of the MLP's hidden units, with no communication. Row-parallel (input columns split): o_proj and
down_proj. Each rank's product is a partial sum of the full output, so one all-reduce after attention
and one after the MLP add them up. The embedding and the head are split over the vocabulary: the
head's weights are a large share of a small model's bytes (Qwen2.5-0.5B: 136M of 494M parameters), and
every rank would read all of them each step if it were replicated.

GQA: with N ranks and K key/value heads, N <= K gives each rank K/N of them. N > K replicates: each
k/v head is held by N/K ranks, the ones whose query heads use it. So N must divide the query heads,
the MLP width, and either divide K or be a multiple of it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nanoserve.models.config import ModelConfig
from nanoserve.validation import check_int


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world_size`: its heads, its MLP units, its vocabulary rows."""
    cfg: ModelConfig
    rank: int
    world_size: int

    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads // self.world_size

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_key_value_heads // self.world_size)

    @property
    def replicates_kv(self) -> bool:
        return self.world_size > self.cfg.num_key_value_heads

    @property
    def first_kv_head(self) -> int:
        # the k/v head of this rank's first query head (GQA: query head h reads k/v head h // group)
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return (self.rank * self.heads) // group

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and head per rank; the last rank's shard is padded when N does not divide it."""
        return -(-self.cfg.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The config of this rank's shard: what its attention and MLP modules are built with."""
        return dataclasses.replace(self.cfg, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   intermediate_size=self.cfg.intermediate_size // self.world_size)

    def slice_of(self, name: str, shape: list[int]) -> tuple[int, slice] | None:
        """(dim, range) of checkpoint tensor `name` (full shape `shape`) this rank holds; None: all of it."""
        d, r = self.cfg.head_dim, self.rank
        part = name.rsplit(".", 2)[-2:]       # e.g. ["q_proj", "weight"]
        layer, kind = part[0], part[1]
        if layer == "q_proj":
            return 0, slice(r * self.heads * d, (r + 1) * self.heads * d)
        if layer in ("k_proj", "v_proj"):
            first = self.first_kv_head
            return 0, slice(first * d, (first + self.kv_heads) * d)
        if layer in ("gate_proj", "up_proj"):
            n = self.cfg.intermediate_size // self.world_size
            return 0, slice(r * n, (r + 1) * n)
        if layer == "o_proj" and kind == "weight":
            return 1, slice(r * self.heads * d, (r + 1) * self.heads * d)
        if layer == "down_proj" and kind == "weight":
            n = self.cfg.intermediate_size // self.world_size
            return 1, slice(r * n, (r + 1) * n)
        if layer in ("embed_tokens", "lm_head"):
            return 0, slice(self.vocab_start, min(self.vocab_start + self.vocab_rows, shape[0]))
        return None   # norms, row-parallel biases (added once, after the all-reduce)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (tests and random weights; the loader slices on disk)."""
        where = self.slice_of(name, list(full.shape))
        if where is None:
            return full
        dim, rows = where
        return self.pad_vocab(name, full.narrow(dim, rows.start, rows.stop - rows.start))

    def pad_vocab(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Zero rows that pad the last vocabulary shard to `vocab_rows` (their logits are cut off after the gather)."""
        if name.split(".")[-2] in ("embed_tokens", "lm_head") and t.shape[0] < self.vocab_rows:
            t = torch.cat([t, t.new_zeros(self.vocab_rows - t.shape[0], *t.shape[1:])])
        return t


def check_tensor_parallel_size(cfg: ModelConfig, n, device: torch.device) -> int:
    """A ValueError, before any process starts, for a size this model or machine cannot run."""
    check_int("tensor_parallel_size", n)
    heads, kv, width = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % n:
        raise ValueError(f"tensor_parallel_size = {n} does not divide the model's {heads} attention heads")
    if (n <= kv and kv % n) or (n > kv and n % kv):
        raise ValueError(f"tensor_parallel_size = {n} must divide the model's {kv} key/value heads or be a "
                         f"multiple of them (then each k/v head is replicated on {n}/{kv} ranks)")
    if width % n:
        raise ValueError(f"tensor_parallel_size = {n} does not divide the MLP width (intermediate_size {width})")
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size = {n} needs {n} GPUs; torch sees {torch.cuda.device_count()}")
    return n
