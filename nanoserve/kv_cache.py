"""Chapter 02: the KV cache. Keys and values of every past token, so each new token is computed once.

Layout: per layer, `num_slots` rows of `max_len` positions ([slot, position, kv_head, head_dim]);
a sequence owns one row (slot) while it runs. A forward step is *varlen*: the tokens of all scheduled
sequences are flattened into one row of N tokens, and `prepare()` says which tokens belong to which
sequence. Decodes (one new token each) attend in one batched call; prefills (many new tokens, maybe a
later chunk of a long prompt) attend one sequence at a time with a causal mask offset by what is cached.
Chapter 04 replaces "one row per sequence" by blocks handed out on demand.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention import decode_attention, kv_bytes_per_token, prefill_attention
from nanoserve.models.config import ModelConfig


@dataclass
class StepLayout:
    """Where the N flattened tokens of one step go: per sequence, its slot, first new position, count."""
    slots: list[int]
    starts: list[int]     # position of the sequence's first new token (= tokens already cached)
    lengths: list[int]    # new tokens this step
    # derived tensors (built once per step, shared by all layers)
    token_slots: torch.Tensor = None
    token_positions: torch.Tensor = None
    decode_tokens: torch.Tensor = None    # indices (into the N tokens) of single-token sequences
    decode_slots: torch.Tensor = None
    decode_context: torch.Tensor = None   # keys each decode attends to (start + 1)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, device="cpu", dtype=torch.float32):
        shape = (cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots, self.max_len = num_slots, max_len
        self.sliding_window = cfg.sliding_window
        self.layout: StepLayout | None = None

    bytes_per_token = staticmethod(kv_bytes_per_token)   # 2 (K and V) x layers x kv_heads x head_dim x bytes

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prepare(self, slots: list[int], starts: list[int], lengths: list[int]) -> None:
        """Describe the next forward: sequence i writes `lengths[i]` tokens at `starts[i]..` of row `slots[i]`."""
        for slot, start, n in zip(slots, starts, lengths):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is outside the cache's {self.num_slots} slots")
            if start + n > self.max_len:
                raise ValueError(f"sequence in slot {slot} needs {start + n} positions; the cache holds {self.max_len}")
        dev = self.k.device
        lay = StepLayout(list(slots), list(starts), list(lengths))
        lay.token_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], device=dev)
        lay.token_positions = torch.tensor([p for st, n in zip(starts, lengths) for p in range(st, st + n)], device=dev)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        dec = [i for i, n in enumerate(lengths) if n == 1]
        lay.decode_tokens = torch.tensor([offsets[i] for i in dec], device=dev, dtype=torch.long)
        lay.decode_slots = torch.tensor([slots[i] for i in dec], device=dev, dtype=torch.long)
        lay.decode_context = torch.tensor([starts[i] + 1 for i in dec], device=dev, dtype=torch.long)
        lay.offsets = offsets
        self.layout = lay

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v, then attention over each sequence's cached keys. q: [1, N, heads, d]."""
        lay = self.layout
        if lay is None:
            raise RuntimeError("KVCache.prepare() must describe the step before the forward pass")
        q, k, v = q[0], k[0], v[0]
        kc, vc = self.k[layer], self.v[layer]
        kc[lay.token_slots, lay.token_positions] = k
        vc[lay.token_slots, lay.token_positions] = v
        out = torch.empty_like(q)
        if len(lay.decode_tokens):  # all single-token sequences together: keys padded to the longest, masked
            ctx = int(lay.decode_context.max())
            keys = kc[lay.decode_slots, :ctx].transpose(1, 2)            # [D, kv_heads, ctx, d]
            vals = vc[lay.decode_slots, :ctx].transpose(1, 2)
            out[lay.decode_tokens] = decode_attention(q[lay.decode_tokens], keys, vals, lay.decode_context,
                                                      self.sliding_window)
        for i, (slot, start, n) in enumerate(zip(lay.slots, lay.starts, lay.lengths)):
            if n == 1:
                continue
            a, b = lay.offsets[i], lay.offsets[i + 1]
            qs = q[a:b].transpose(0, 1)[None]                             # [1, heads, n, d]
            keys = kc[slot, :start + n].transpose(0, 1)[None]             # [1, kv_heads, ctx, d]
            vals = vc[slot, :start + n].transpose(0, 1)[None]
            out[a:b] = prefill_attention(qs, keys, vals, start, self.sliding_window)[0].transpose(0, 1)
        return out[None]

