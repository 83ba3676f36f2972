"""Chapter 06: decode steps at a few static shapes, so torch.compile can run each as one graph.

A decode step's shapes change every step: how many sequences decode, and how many KV blocks each reads.
A compiled graph is specialised to its shapes, so we make them few. The batch is padded up to a bucket
(1, 2, 4, 8, then steps of 8, as vLLM and nano-vllm do), and every block table to a width bucket (a power
of two of blocks). Padding rows write their key and value into a scratch block that no sequence owns and
attend only to it; their logits are dropped. One graph per (batch, width) bucket, compiled the first
time the bucket is used; prefills, mixed steps and batches above the largest bucket run eager.

Attention here gathers each row's (padded) blocks and masks past its length, with PyTorch ops only, so
the whole step, attention included, is one graph with no breaks.
"""
from __future__ import annotations

import bisect
import time
from collections import Counter

import torch
import torch._dynamo

from nanoserve.attention.functional import decode_attention
from nanoserve.attention.metadata import Padding, StepInputs

MODES = ("eager", "compile", "cudagraph")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a graph: 1, 2, 4, 8, then steps of 8, the last one covering max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sizes + [-(-max_num_seqs // 8) * 8 if max_num_seqs > 8 else max_num_seqs]


def bucket_for(buckets: list[int], n: int) -> int:
    """The smallest of the (sorted) batch buckets that holds `n` sequences."""
    return buckets[bisect.bisect_left(buckets, n)]


def width_bucket(blocks: int) -> int:
    """Block-table width with a graph: the next power of two."""
    return 1 << max(0, blocks - 1).bit_length()


def resolve_mode(compilation: str | None, enforce_eager: bool, device: torch.device, sharded: bool = False) -> str:
    """The compilation mode an LLM runs: its argument checked against the device; vLLM's enforce_eager wins.

    The default is "cudagraph" on CUDA (a small model's decode is launch-bound there) and "eager" on a CPU
    (compiling costs tens of seconds there) and for a sharded model (tensor parallelism runs eager).
    """
    if enforce_eager:
        return "eager"
    if compilation is None:
        return "cudagraph" if device.type == "cuda" and not sharded else "eager"
    if compilation not in MODES:
        raise ValueError(f"compilation = {compilation!r}: expected one of {', '.join(map(repr, MODES))}")
    if compilation == "cudagraph" and device.type != "cuda":
        raise ValueError(f"compilation = 'cudagraph' needs a CUDA device; this LLM runs on {device.type!r} "
                         f"(use 'compile' or 'eager')")
    return compilation


class StaticDecodeAttention:
    """Paged decode attention at static shapes: every row reads `tables.shape[1]` blocks, masked to its length.

    The pools come as `[layers*blocks*block_size, kv_heads, d]` graph inputs, written with `index_put_` on the
    pool itself: through a view of a layer, inductor copied that layer's whole pool every step.
    """

    def __init__(self, flat_k, flat_v, num_blocks, block_size, sliding_window, slots, tables, context):
        self.flat_k, self.flat_v, self.num_blocks, self.block_size = flat_k, flat_v, num_blocks, block_size
        self.sliding_window, self.slots, self.tables, self.context = sliding_window, slots, tables, context

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]                                   # [B, heads, d], [B, kv_heads, d]
        bs, first = self.block_size, layer * self.num_blocks         # this layer's blocks start at `first`
        self.flat_k.index_put_((self.slots + first * bs,), k)
        self.flat_v.index_put_((self.slots + first * bs,), v)
        B, W = self.tables.shape
        rows = ((self.tables + first)[..., None] * bs + torch.arange(bs, device=q.device)).flatten()
        keys = self.flat_k.index_select(0, rows).view(B, W * bs, *k.shape[1:]).transpose(1, 2)
        vals = self.flat_v.index_select(0, rows).view(B, W * bs, *v.shape[1:]).transpose(1, 2)
        return decode_attention(q, keys, vals, self.context, self.sliding_window)[None]


class CompiledDecode:
    """The engine's decode steps through torch.compile, one graph per (batch, width) bucket.

    `num_compiles` counts graphs compiled; `num_recompiles` those compiled again for a bucket that already
    had one (a guard failed: in steady decoding it stays 0, and a test holds it there); `compile_seconds`
    is the wall time of the steps that compiled.
    """

    def __init__(self, model, cache, max_num_seqs: int, scratch_block: int):
        self.model, self.cache, self.scratch_block = model, cache, scratch_block
        self.inputs = StepInputs(cache.block_size, cache.k.device)
        # the pools as one row per cached token, built once: views of the same storage, passed to every step
        self.flat_k, self.flat_v = (t.view(-1, *t.shape[-2:]) for t in (cache.k, cache.v))
        self.sliding_window = model.config.sliding_window
        self.buckets = batch_buckets(max_num_seqs)
        self.compiles: Counter = Counter()     # bucket -> graphs compiled for it
        self.compile_seconds = 0.0             # wall time of the steps that compiled a graph: the cost
        self._bucket = None
        self._step = torch.compile(self._forward, backend=self._counting_inductor, dynamic=False, fullgraph=True)
        # one entry per bucket lives in the cache of this one function: room for all of them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def _counting_inductor(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        self.compiles[self._bucket] += 1
        return compile_fx(gm, example_inputs)

    @property
    def num_compiles(self) -> int:
        return sum(self.compiles.values())

    @property
    def num_recompiles(self) -> int:
        return sum(n - 1 for n in self.compiles.values())

    def _forward(self, ids, positions, slots, tables, context, flat_k, flat_v):
        attention = StaticDecodeAttention(flat_k, flat_v, self.cache.k.shape[1], self.cache.block_size,
                                          self.sliding_window, slots, tables, context)
        hidden = self.model.hidden_states(ids[None], positions[None], attention)[0]
        return self.model.lm_head(hidden).float()

    def accepts(self, plan) -> bool:
        """A step this path runs: decodes only (one new token each), no more than the largest bucket."""
        return len(plan.token_ids) <= self.buckets[-1] and all(len(t) == 1 for t in plan.token_ids)

    def pad(self, plan) -> tuple[tuple[int, int], list[torch.Tensor]]:
        """The step's inputs padded to its bucket: ((batch, width), [ids, positions, slots, tables, context])."""
        B = bucket_for(self.buckets, len(plan.token_ids))
        W = width_bucket(max(s // self.cache.block_size + 1 for s in plan.starts))
        a = self.inputs.arrays(plan.token_ids, plan.starts, plan.block_tables, Padding(B, W, self.scratch_block))
        device = self.cache.k.device
        return (B, W), [torch.from_numpy(a[k]).to(device, torch.int64) for k in ("ids", "positions", "slots", "tables",
                                                                                  "context")]

    def forward(self, plan) -> torch.Tensor:
        """The fp32 logits of every sequence of a decode step (each samples), through its bucket's graph."""
        self._bucket, inputs = self.pad(plan)
        compiled_before, start = self.num_compiles, time.perf_counter()
        logits = self._step(*inputs, self.flat_k, self.flat_v)
        if self.num_compiles != compiled_before:
            self.compile_seconds += time.perf_counter() - start
        return logits[:len(plan.token_ids)]
