"""One step's attention metadata, built once per step on the device and read by every layer.

A step is *varlen*: the new tokens of all scheduled sequences are flattened into one row of N tokens.
Sequence i contributes lengths[i] tokens at positions starts[i].. (starts[i] tokens are cached
already). From those per-sequence numbers and the block tables, everything per token is computed with
tensor ops, never a Python loop over tokens:

    positions[t]    = starts[seq[t]] + (t - first token of seq[t])
    slot_mapping[t] = block_tables[seq[t], positions[t] // block_size] * block_size + positions[t] % block_size

The per-sequence numbers travel to the device in one copy: `StepInputs` packs them with the token ids
into one staging buffer (pinned on CUDA, so the copy runs asynchronously) that lives as long as the
engine; only the first N + ... entries of it are used each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step, for every layer."""
    positions: torch.Tensor        # [N] long: each new token's position in its sequence
    slot_mapping: torch.Tensor     # [N] long: the flat cache row its key and value are written to
    block_tables: torch.Tensor     # [B, W] int32: each sequence's blocks, -1 past its last one
    context_lens: torch.Tensor     # [B] int32: keys each sequence has once this step is stored
    decode_seqs: torch.Tensor      # [D] long: the sequences with one new token (decodes) ...
    decode_tokens: torch.Tensor    # [D] long: ... and that token's index among the N
    prefills: list[tuple[int, int, int, int]]   # (sequence, first token, new tokens, start) of the others
    block_size: int
    decode_blocks: list[int] = field(default_factory=list)  # blocks each decode reads (host ints)
    scratch: dict = field(default_factory=dict)  # what a backend derives once per step (torch: length groups)

    last_tokens: list[int] = field(default_factory=list)  # index of each sequence's last new token (host ints)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class StepInputs:
    """Builds each step's input ids and AttentionMetadata, staging host numbers through one buffer."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.device = torch.device(device)
        self._host = torch.empty(0, dtype=torch.int64)

    def _staging(self, size: int) -> torch.Tensor:
        if self._host.numel() < size:   # grows to the largest step seen, then stays
            self._host = torch.empty(max(size, 2 * self._host.numel()), dtype=torch.int64,
                                     pin_memory=self.device.type == "cuda")
        return self._host[:size]

    def build(self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]]):
        """token_ids[i]: sequence i's new tokens this step; starts[i]: its tokens already cached;
        block_tables[i]: its blocks. Returns (input_ids [1, N], AttentionMetadata)."""
        bs = self.block_size
        lengths = [len(t) for t in token_ids]
        for i, (table, start, n) in enumerate(zip(block_tables, starts, lengths)):
            if n < 1:
                raise ValueError(f"sequence {i} of the step has no new tokens")
            if len(table) * bs < start + n:
                raise ValueError(f"block table {table} covers {len(table) * bs} positions; the step needs {start + n}")
        B, N = len(lengths), sum(lengths)
        decodes = [i for i, n in enumerate(lengths) if n == 1]
        firsts, offset = [], 0
        for n in lengths:
            firsts.append(offset)
            offset += n
        table_lens = [len(t) for t in block_tables]
        parts = [[t for ids in token_ids for t in ids], starts, lengths, table_lens, decodes,
                 [firsts[i] for i in decodes], [b for t in block_tables for b in t]]
        host = self._staging(sum(len(p) for p in parts))
        host.numpy()[:] = [x for p in parts for x in p]
        flat = host.to(self.device, non_blocking=True)
        ids, starts_t, lens_t, tlens_t, dec_seqs, dec_tokens, tables_flat = flat.split([len(p) for p in parts])

        arange_b = torch.arange(B, device=self.device)
        seq = torch.repeat_interleave(arange_b, lens_t, output_size=N)
        first = torch.cumsum(lens_t, 0) - lens_t
        positions = starts_t[seq] + torch.arange(N, device=self.device) - first[seq]
        width = max(table_lens)
        tables = torch.full((B, width), -1, dtype=torch.int32, device=self.device)
        row = torch.repeat_interleave(arange_b, tlens_t, output_size=len(parts[-1]))
        col = torch.arange(len(parts[-1]), device=self.device) - (torch.cumsum(tlens_t, 0) - tlens_t)[row]
        tables[row, col] = tables_flat.to(torch.int32)
        slot_mapping = tables[seq, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slot_mapping, block_tables=tables,
            context_lens=(starts_t + lens_t).to(torch.int32), decode_seqs=dec_seqs, decode_tokens=dec_tokens,
            prefills=[(i, firsts[i], n, s) for i, (s, n) in enumerate(zip(starts, lengths)) if n != 1],
            block_size=bs, decode_blocks=[-(-(starts[i] + 1) // bs) for i in decodes],
            last_tokens=[f + n - 1 for f, n in zip(firsts, lengths)])
        return ids[None], meta
