"""Chapter 06: decode steps replayed from CUDA graphs, one graph per batch bucket.

On a GPU a small model's decode step is a few hundred kernels of a few microseconds each, and the host
launching them, not the GPU running them, sets the pace. A CUDA graph records one step's launches once
and replays all of them with one call. A replay repeats exactly what was recorded: the same kernels on
the same addresses at the same shapes. So:

- the step reads its inputs from buffers that live as long as the engine; each step's ids, positions,
  cache rows, block tables and lengths are built as the eager step's are (`attention.StepInputs`, padded),
  sent from pinned memory, copied into those buffers, then the graph replays;
- the batch is padded to a bucket (`batch_buckets`); padding rows write their key and value into the
  scratch block, which no sequence owns, attend to it alone, and their logits are dropped;
- every block table is padded to the widest a sequence can have (max_model_len): the decode kernel
  reads only the blocks a row's length covers, so the unused width costs nothing.

Graphs are captured when the engine starts, largest bucket first, in one shared memory pool: a smaller
bucket's intermediate tensors reuse what the largest one reserved. The capture's seconds and bytes are
reported. Prefills, mixed steps and batches above the largest bucket run eager.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from nanoserve.attention.metadata import Padding, StepInputs
from nanoserve.engine.compiled_decode import StaticDecodeAttention, batch_buckets, bucket_for


class InPlaceDecodeAttention:
    """Decode attention over the step buffers: store k/v in their rows, then the paged kernel reads the blocks."""

    def __init__(self, cache, ops, cfg, slots, tables, context):
        self.cache, self.ops, self.slots, self.tables, self.context = cache, ops, slots, tables, context
        self.scale, self.sliding_window = cfg.head_dim ** -0.5, cfg.sliding_window

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]                                     # [B, heads, d], [B, kv_heads, d]
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc.view(-1, *kc.shape[-2:]).index_copy_(0, self.slots, k)
        vc.view(-1, *vc.shape[-2:]).index_copy_(0, self.slots, v)
        out = self.ops.paged_decode_attention(q, kc, vc, self.tables, self.context, self.scale, self.sliding_window)
        return out.to(q.dtype)[None]


class CudaGraphDecode:
    """The engine's decode steps as CUDA graph replays, one graph per batch bucket, captured at start.

    `capture_seconds` and `memory_bytes` are what the capture cost; graphs never recompile, so
    `num_recompiles` is 0 and `num_compiles` is the number of graphs.
    """

    def __init__(self, model, cache, ops, max_num_seqs: int, max_model_len: int, scratch_block: int,
                 capture: bool = True):
        self.model, self.cache, self.ops, self.scratch_block = model, cache, ops, scratch_block
        self.buckets = batch_buckets(max_num_seqs)
        self.width = -(-max_model_len // cache.block_size)    # blocks of the longest sequence
        self.inputs = StepInputs(cache.block_size, cache.k.device)   # built and sent as the eager step is
        B, W, dev = self.buckets[-1], self.width, cache.k.device
        # the step buffers every graph reads; each step's inputs are copied into their first rows
        self.static = dict(ids=torch.zeros(B, dtype=torch.long, device=dev),
                           positions=torch.zeros(B, dtype=torch.long, device=dev),
                           slots=torch.zeros(B, dtype=torch.long, device=dev),
                           tables=torch.zeros(B, W, dtype=torch.int32, device=dev),
                           context=torch.zeros(B, dtype=torch.int32, device=dev))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}     # each graph's output, overwritten by each replay
        self.capture_seconds, self.memory_bytes = self._capture_all() if capture else (0.0, 0)

    @property
    def num_compiles(self) -> int:
        return len(self.graphs)

    num_recompiles = 0

    @property
    def compile_seconds(self) -> float:
        return self.capture_seconds

    def _attention(self, b: int):
        s = {k: v[:b] for k, v in self.static.items()}
        if not self.ops.decode_in_place:   # the reference reads each length on the host: gather every block instead
            flat_k, flat_v = (t.view(-1, *t.shape[-2:]) for t in (self.cache.k, self.cache.v))
            return StaticDecodeAttention(flat_k, flat_v, self.cache.num_blocks, self.cache.block_size,
                                         self.model.config.sliding_window, s["slots"], s["tables"], s["context"])
        return InPlaceDecodeAttention(self.cache, self.ops, self.model.config, s["slots"], s["tables"], s["context"])

    def _forward(self, b: int) -> torch.Tensor:
        attention = self._attention(b)
        ids, positions = self.static["ids"][:b], self.static["positions"][:b]
        hidden = self.model.hidden_states(ids[None], positions[None], attention)[0]
        return self.model.lm_head(hidden).float()

    @torch.inference_mode()
    def _capture_all(self) -> tuple[float, int]:
        """Capture every bucket's graph, largest first, into one pool. Returns (seconds, bytes reserved)."""
        dev = self.cache.k.device
        self._stage_arrays([], [], [], self.buckets[-1])   # every row a padding row
        torch.cuda.synchronize(dev)
        before, start = torch.cuda.memory_reserved(dev), time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            side = torch.cuda.Stream(dev)          # warm up off the capture (Triton compiles, lazy tables)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)
        return time.perf_counter() - start, torch.cuda.memory_reserved(dev) - before

    def accepts(self, plan) -> bool:
        """A step this path runs: decodes only, no more than the largest bucket, tables within the width."""
        return (len(plan.token_ids) <= self.buckets[-1] and all(len(t) == 1 for t in plan.token_ids)
                and all(s // self.cache.block_size < self.width for s in plan.starts))

    def _stage_arrays(self, token_ids, starts, block_tables, b: int) -> None:
        """A decode step padded to b rows (the eager step's builder, sent from its pinned buffers, one copy per
        dtype), copied into the first b rows of the graph's buffers on the stream the replay runs on."""
        a = self.inputs.arrays(token_ids, starts, block_tables, Padding(b, self.width, self.scratch_block))
        longs = self.inputs.to_device([a["ids"], a["positions"], a["slots"]], np.int64)
        ints = self.inputs.to_device([a["tables"], a["context"]], np.int32)
        for name, t in zip(("ids", "positions", "slots", "tables", "context"), longs + ints):
            self.static[name][:b].copy_(t)

    def _stage_plan(self, plan) -> tuple[int, int]:
        """Stage a decode step padded to its bucket; returns (its sequences, the bucket)."""
        n = len(plan.token_ids)
        b = bucket_for(self.buckets, n)
        self._stage_arrays(plan.token_ids, plan.starts, plan.block_tables, b)
        return n, b

    @torch.inference_mode()
    def forward(self, plan) -> torch.Tensor:
        """The fp32 logits of every sequence of a decode step (each samples), replayed from its bucket's graph."""
        n, b = self._stage_plan(plan)
        self.graphs[b].replay()
        return self.logits[b][:n]

    @torch.inference_mode()
    def eager(self, plan) -> torch.Tensor:
        """The same padded step run without its graph: the reference a replay must equal bit for bit (and,
        on a CPU, where nothing is captured, a check of everything but the capture)."""
        n, b = self._stage_plan(plan)
        return self._forward(b)[:n].clone()
