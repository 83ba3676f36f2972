"""Chapter 04: attention over the paged KV cache. Chapter 05: the same through kernels.

Storage (`PagedKVCache`), per layer: `num_blocks` blocks of `block_size` positions, [block, offset,
kv_head, head_dim]. Token position p of a sequence with block table T sits at flat row
`T[p // block_size] * block_size + p % block_size` of the layer's [num_blocks * block_size, kv_head,
head_dim] view; the step's `AttentionMetadata.slot_mapping` holds that row for every new token.

`PagedAttention` is the layer the model calls, once per decoder layer per step: store the step's k/v
in their rows, then attend. Its backend is chosen once, when the engine builds it:

- decodes (one new token) read their keys through the block table: in place with the C kernel
  (backend "cpu") or the Triton kernel ("triton"); the PyTorch reference ("torch") gathers each
  decode's blocks into a padded copy, decodes of similar length together;
- a prefill with nothing cached attends its own fresh k/v, no cache read at all; a later chunk (or the
  rest of a prompt after a prefix-cache hit) gathers its cached prefix, then causal attention. That
  work is compute-bound (n queries x context keys): SDPA's blocked matmuls beat the C kernel's
  one-query-at-a-time loop by more than the copy costs (measured on a 2-core CPU, 512 cached + 64 new
  tokens: gather + SDPA 0.64 ms, C kernel in place 2.0 ms; at 16 new tokens 0.31 vs 0.51 ms).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nanoserve.attention.functional import decode_attention, prefill_attention
from nanoserve.attention.metadata import AttentionMetadata, StepInputs
from nanoserve.kernels import REFERENCE, KernelSet


def kv_bytes_per_token(cfg, dtype=torch.float32) -> int:
    """K and V of one position in every layer: 2 x layers x kv_heads x head_dim x bytes per element."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class PagedKVCache:
    """The block pool: keys and values of every layer. Owned by the engine, read by PagedAttention."""

    def __init__(self, cfg, num_blocks: int, block_size: int, device="cpu", dtype=torch.float32):
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # zeros, not empty: the torch path gathers whole blocks and masks the padding, and 0 * NaN is NaN
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg, block_size: int, dtype=torch.float32) -> int:
        """K and V of `block_size` positions in every layer."""
        return block_size * kv_bytes_per_token(cfg, dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class DecodeGroup:
    """Decodes of similar length, attended together by the torch path: blocks gathered, padded to the longest."""
    tokens: torch.Tensor            # [G] which of the step's N tokens
    blocks: torch.Tensor            # [G, max_blocks] block ids (padding: block 0, masked)
    context_lens: torch.Tensor      # [G] keys of each


class PagedAttention:
    """Attention over a PagedKVCache with one backend's kernels; `metadata` describes the current step."""

    def __init__(self, cache: PagedKVCache, cfg, ops: KernelSet = REFERENCE):
        self.cache, self.ops = cache, ops
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5
        self.metadata: AttentionMetadata | None = None
        self._in_step = False
        # chosen once: the reference gathers blocks, the kernels read them in place
        self._decode = self._decode_in_place if ops.decode_in_place else self._decode_gathered
        self._inputs: StepInputs | None = None
        # Gathered copies of blocks land in a reused buffer on a CPU. Allocated afresh each layer, a copy of tens
        # of MB goes back to glibc and the next one is carved from wherever it fits: under torch.profiler (whose
        # records fill the freed gaps) the heap grew by GBs a step, every copy paid fresh page faults, and the
        # profile blamed the attention for the allocator's work. CUDA's caching allocator already reuses blocks.
        self._workspace: dict[str, torch.Tensor] | None = {} if cache.k.device.type == "cpu" else None

    @contextmanager
    def step(self, metadata: AttentionMetadata):
        """The forward inside runs the step `metadata` describes (the engine's way in); steps do not nest."""
        if self._in_step:
            raise RuntimeError("PagedAttention is already running a step: one forward at a time")
        self.metadata, self._in_step = metadata, True
        try:
            yield self
        finally:
            self.metadata, self._in_step = None, False

    def prepare(self, block_tables: list[list[int]], starts: list[int], lengths: list[int]) -> None:
        """Describe the next forward from plain lists (for notebooks and tests; the engine builds its
        metadata with its own StepInputs): sequence i writes lengths[i] tokens at positions starts[i].."""
        if self._inputs is None:
            self._inputs = StepInputs(self.cache.block_size, self.cache.k.device)
        _, self.metadata = self._inputs.build([[0] * n for n in lengths], starts, block_tables)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v in their blocks, then attention through the block tables. q: [1, N, heads, d]."""
        meta = self.metadata
        if meta is None:
            raise RuntimeError("PagedAttention needs the step's metadata (prepare(), or the engine's step()) "
                               "before the forward")
        q, k, v = q[0], k[0], v[0]
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        _, _, kvh, d = kc.shape
        kc.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        vc.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if len(meta.decode_blocks):
            self._decode(meta, q, kc, vc, out)
        for s, first, n, start in meta.prefills:
            qs = q[first:first + n].transpose(0, 1)                                   # [heads, n, d]
            if start == 0:      # nothing cached before it: its own k/v are the keys
                keys, vals = k[first:first + n].transpose(0, 1), v[first:first + n].transpose(0, 1)
            else:
                blocks = meta.block_tables[s, :-(-(start + n) // meta.block_size)].long()
                keys = self._gather("k", kc, blocks).view(-1, kvh, d)[:start + n].transpose(0, 1)
                vals = self._gather("v", vc, blocks).view(-1, kvh, d)[:start + n].transpose(0, 1)
            if self.ops.own_prefill:
                o = self.ops.flash_prefill(qs, keys, vals, start, self.scale, self.sliding_window)
            else:
                o = prefill_attention(qs[None], keys[None], vals[None], start, self.sliding_window)[0]
            out[first:first + n] = o.transpose(0, 1)
        return out[None]

    def _decode_in_place(self, meta, q, kc, vc, out) -> None:
        qd = q if meta.all_decodes else q[meta.decode_tokens]
        o = self.ops.paged_decode_attention(qd, kc, vc, meta.decode_tables, meta.decode_context, self.scale,
                                            self.sliding_window).to(q.dtype)
        if meta.all_decodes:
            out.copy_(o)
        else:
            out[meta.decode_tokens] = o

    def _decode_gathered(self, meta, q, kc, vc, out) -> None:
        _, _, kvh, d = kc.shape
        for g in self._groups(meta):
            G = len(g.tokens)
            keys = self._gather("k", kc, g.blocks.flatten()).view(G, -1, kvh, d).transpose(1, 2)  # [G, kv_heads, ctx, d]
            vals = self._gather("v", vc, g.blocks.flatten()).view(G, -1, kvh, d).transpose(1, 2)
            out[g.tokens] = decode_attention(q[g.tokens], keys, vals, g.context_lens, self.sliding_window)

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache[blocks] (whole blocks, [n, block_size, kv_heads, d]); on a CPU into a buffer kept between calls,
        valid until the next gather of the same `name` (the caller is done with it by then)."""
        if self._workspace is None or torch.compiler.is_compiling():   # a compiled graph plans its own buffers
            return cache.index_select(0, blocks)
        n, shape = blocks.numel(), cache.shape[1:]
        buf = self._workspace.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != shape or buf.dtype != cache.dtype:
            buf = self._workspace[name] = cache.new_empty((max(n, 1), *shape))
        return torch.index_select(cache, 0, blocks, out=buf[:n])

    @staticmethod
    def _groups(meta: AttentionMetadata) -> list[DecodeGroup]:
        """Decodes grouped by length, once per step (the first layer builds them, the others reuse them)."""
        if "decode_groups" not in meta.scratch:
            order = sorted(range(len(meta.decode_blocks)), key=lambda i: meta.decode_blocks[i])
            groups = []
            for lo, hi in split_by_length([meta.decode_blocks[i] for i in order]):
                rows = torch.tensor(order[lo:hi], device=meta.positions.device)
                width = meta.decode_blocks[order[hi - 1]]
                groups.append(DecodeGroup(meta.decode_tokens[rows], meta.decode_tables[rows, :width].clamp(min=0).long(),
                                          meta.decode_context[rows]))
            meta.scratch["decode_groups"] = groups
        return meta.scratch["decode_groups"]


def split_by_length(num_blocks: list[int], max_groups: int = 4, group_cost: int = 16) -> list[tuple[int, int]]:
    """Cut sorted per-sequence block counts into at most `max_groups` runs [lo, hi) that waste less.

    A group costs its size x its longest (the padding is gathered and attended too), plus a fixed
    `group_cost` in blocks for the extra calls. Each run is split in two at its best point while that pays.
    """
    def padded(lo, hi):
        return (hi - lo) * num_blocks[hi - 1] if hi > lo else 0

    runs = [(0, len(num_blocks))] if num_blocks else []
    while len(runs) < max_groups:
        best = None  # (saving, run index, cut)
        for r, (lo, hi) in enumerate(runs):
            for cut in range(lo + 1, hi):
                saving = padded(lo, hi) - padded(lo, cut) - padded(cut, hi) - group_cost
                if saving > 0 and (best is None or saving > best[0]):
                    best = (saving, r, cut)
        if best is None:
            break
        _, r, cut = best
        lo, hi = runs.pop(r)
        runs[r:r] = [(lo, cut), (cut, hi)]
    return runs
