"""Chapter 03: run one scheduled step on the model. Flatten the batch, prepare the cache, forward, sample."""
from __future__ import annotations

import torch

from nanoserve.engine.sequence import Sequence
from nanoserve.paged_kv_cache import PagedKVCache
from nanoserve.models import CausalLM
from nanoserve.sampling import sample


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, seed: int = 0):
        self.model, self.kv_cache = model, kv_cache
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(self.device).manual_seed(seed)  # for requests without their own seed

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> dict[int, int]:
        """Forward the batch's new tokens; return {seq_id: sampled token} for sequences that reached their end."""
        ids, positions, sample_rows, sampled_seqs = [], [], [], []
        for seq, n in batch:
            start = seq.num_cached_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:      # all its known tokens are in: its next token can be drawn
                sample_rows.append(len(ids) - 1)
                sampled_seqs.append(seq)
        self.kv_cache.prepare([s.block_table for s, _ in batch], [s.num_cached_tokens for s, _ in batch],
                              [n for _, n in batch])
        ids_t = torch.tensor([ids], device=self.device)
        pos_t = torch.tensor([positions], device=self.device)
        hidden = self.model.hidden_states(ids_t, pos_t, self.kv_cache)[0]
        if not sampled_seqs:
            return {}
        logits = self.model.lm_head(hidden[sample_rows]).float()  # the head only where we sample
        tokens = sample(logits, [s.params for s in sampled_seqs], [s.generator for s in sampled_seqs],
                        self.generator).tolist()
        return {s.seq_id: t for s, t in zip(sampled_seqs, tokens)}
