"""One step's attention metadata, built once per step and read by every layer.

A step is *varlen*: the new tokens of all scheduled sequences are flattened into one row of N tokens.
Sequence i contributes lengths[i] tokens at positions starts[i].. (starts[i] tokens are cached
already). From those per-sequence numbers and the block tables, everything per token is computed with
array ops, never a Python loop over tokens:

    positions[t]    = starts[seq[t]] + (t - first token of seq[t])
    slot_mapping[t] = block_tables[seq[t], positions[t] // block_size] * block_size + positions[t] % block_size

A decode step that runs at static shapes (chapter 06: a compiled graph, a CUDA graph replay) is built by
the same code with a `Padding` target: the batch padded to a bucket, every block table to one width, the
padding rows and table entries pointing at a scratch block that no sequence owns.

As in vLLM's model runner, the arrays are computed with NumPy on the host (a NumPy call on a small
array costs about a microsecond, a small torch op several) and reach the device in two copies (int64
and int32) from buffers that live as long as the engine, pinned and non-blocking on CUDA. On a CPU
the tensors are views of the arrays: nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step, for every layer."""
    positions: torch.Tensor        # [N] long: each new token's position in its sequence
    slot_mapping: torch.Tensor     # [N] long: the flat cache row its key and value are written to
    block_tables: torch.Tensor     # [B, W] int32: each sequence's blocks, -1 past its last one
    context_lens: torch.Tensor     # [B] int32: keys each sequence has once this step is stored
    decode_tokens: torch.Tensor    # [D] long: the tokens of sequences with one new token (decodes)
    decode_tables: torch.Tensor    # [D, Wd] int32: their block tables
    decode_context: torch.Tensor   # [D] int32: their keys
    prefills: list[tuple[int, int, int, int]]   # (sequence, first token, new tokens, start) of the others
    block_size: int
    all_decodes: bool              # every token is a decode: attention needs no gather/scatter of q
    decode_blocks: list[int] = field(default_factory=list)  # blocks each decode reads (host ints)
    last_tokens: list[int] = field(default_factory=list)    # index of each sequence's last new token
    scratch: dict = field(default_factory=dict)  # what a backend derives once per step (torch: length groups)


@dataclass(frozen=True)
class Padding:
    """A static shape for a decode step: `batch` rows, `width` blocks per table, padding in `scratch_block`."""
    batch: int
    width: int
    scratch_block: int


class StepInputs:
    """Builds each step's input ids and AttentionMetadata from per-sequence numbers."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.device = torch.device(device)
        self._host = {np.int64: torch.empty(0, dtype=torch.int64), np.int32: torch.empty(0, dtype=torch.int32)}
        self._copied = {}   # CUDA: an event per buffer, recorded after its copy was queued

    def to_device(self, parts: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """The arrays as tensors on the device. CPU: views of the arrays, no copy. CUDA: packed into the
        persistent pinned buffer of `dtype` (grown to the largest step seen) and sent in one copy."""
        if self.device.type == "cpu":
            return [torch.from_numpy(p) for p in parts]
        size = sum(p.size for p in parts)
        if self._host[dtype].numel() < size:
            self._host[dtype] = torch.empty(max(size, 2 * self._host[dtype].numel()), dtype=self._host[dtype].dtype,
                                            pin_memory=True)
        if dtype in self._copied:
            self._copied[dtype].synchronize()   # the previous step's copy out of this buffer must be done
        host = self._host[dtype][:size]
        if size:
            np.concatenate([p.ravel() for p in parts], out=host.numpy())
        flat = host.to(self.device, non_blocking=True)
        self._copied[dtype] = torch.cuda.Event()
        self._copied[dtype].record()
        return [t.view(p.shape) for t, p in zip(flat.split([p.size for p in parts]), parts)]

    def arrays(self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]],
               pad: Padding | None = None) -> dict[str, np.ndarray]:
        """The step as host arrays: ids, positions, slots (cache rows), tables, context (keys per sequence).

        token_ids[i]: sequence i's new tokens this step; starts[i]: its tokens already cached; block_tables[i]:
        its blocks (-1 past the last one). With `pad`, a decode step (one new token each) padded to pad.batch
        rows and pad.width blocks per table: a padding row holds one key, its own, in the scratch block, and
        table entries past a row's blocks point there too (masked by the row's length)."""
        bs = self.block_size
        lengths = [len(t) for t in token_ids]
        if pad is not None and any(n != 1 for n in lengths):
            raise ValueError(f"a padded step is decodes only, one new token each; this one has {lengths}")
        for i, (table, start, n) in enumerate(zip(block_tables, starts, lengths)):
            if n < 1:
                raise ValueError(f"sequence {i} of the step has no new tokens")
            if len(table) * bs < start + n:
                raise ValueError(f"block table {table} covers {len(table) * bs} positions; the step needs {start + n}")
        if pad is None:
            lens, start_a = np.array(lengths, dtype=np.int64), np.array(starts, dtype=np.int64)
        else:   # padding rows: one token at position 0
            lens, start_a = np.ones(pad.batch, dtype=np.int64), np.zeros(pad.batch, dtype=np.int64)
            start_a[:len(starts)] = starts
        B = len(lens)
        first = np.cumsum(lens) - lens
        seq = np.repeat(np.arange(B), lens)
        positions = start_a[seq] + np.arange(seq.size) - first[seq]
        context = (start_a + lens).astype(np.int32)
        ids = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=sum(lengths))
        if pad is None:
            tables = np.full((B, max(len(t) for t in block_tables)), -1, dtype=np.int32)
            for i, t in enumerate(block_tables):      # per sequence, not per token
                tables[i, :len(t)] = t
        else:
            tables = np.full((B, pad.width), pad.scratch_block, dtype=np.int32)
            for i, t in enumerate(block_tables):      # the blocks its keys fill; the rest: scratch, masked
                used = -(-(starts[i] + 1) // bs)
                tables[i, :used] = t[:used]
            ids = np.concatenate([ids, np.zeros(B - len(lengths), dtype=np.int64)])
        # each new token's cache row: its sequence's block for the position, times block_size, plus the offset
        slots = tables[seq, positions // bs].astype(np.int64) * bs + positions % bs
        return dict(ids=ids, positions=positions, slots=slots, tables=tables, context=context, first=first, lens=lens)

    def build(self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]]):
        """The step's input ids [1, N] and AttentionMetadata on the device (arguments: `arrays`). The padded
        decode steps (compiled, CUDA graphs) take `arrays` with a Padding and send only what their graph reads."""
        a = self.arrays(token_ids, starts, block_tables)
        tables, context, first, lens = a["tables"], a["context"], a["first"], a["lens"]
        dec = np.flatnonzero(lens == 1)
        decode_blocks = [-(-int(c) // self.block_size) for c in context[dec]]
        ids_t, pos_t, slots_t, dec_tok_t = self.to_device([a["ids"], a["positions"], a["slots"], first[dec]], np.int64)
        dec_tables = tables[dec, :max(decode_blocks, default=0)]
        tables_t, ctx_t, dec_tables_t, dec_ctx_t = self.to_device([tables, context, dec_tables, context[dec]], np.int32)
        meta = AttentionMetadata(
            positions=pos_t, slot_mapping=slots_t, block_tables=tables_t, context_lens=ctx_t,
            decode_tokens=dec_tok_t, decode_tables=dec_tables_t, decode_context=dec_ctx_t,
            prefills=[(i, int(first[i]), n, s) for i, (s, n) in enumerate(zip(starts, lens.tolist())) if n != 1],
            block_size=self.block_size, all_decodes=len(dec) == len(lens), decode_blocks=decode_blocks,
            last_tokens=(first + lens - 1).tolist())
        return ids_t[None], meta
