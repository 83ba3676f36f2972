"""Chapter 10: who proposes the k tokens the target verifies.

- `NgramProposer` (vLLM's "ngram", prompt lookup decoding): find the last n tokens earlier in the sequence
  (prompt and output) and propose what followed them there. Free to run, and strong wherever the output
  repeats its context: code that reuses its identifiers, an edit of a given text, extraction.
- `DraftModelProposer` (vLLM's "draft_model"): a small model of the same tokenizer runs k decode steps
  ahead. It keeps its own paged KV cache, one block table per sequence, caught up each step with the tokens
  the target accepted since (one chunked forward), then k - 1 single-token steps.
"""
from __future__ import annotations

import torch

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import ModelRunner, StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling import probs


class Proposer:
    """What the speculative decoder asks of a proposer. `propose` is required; a proposer that keeps state per
    sequence (a draft model's cache) also hears what was accepted and which sequences still run."""

    def propose(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to limits[i] draft tokens for each sequence, and the distribution each was drawn from (None for a
        point mass)."""
        raise NotImplementedError

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After verification: `num_accepted` of the sequence's `num_drafts` drafts were kept."""

    def release(self, keep: set[str]) -> None:
        """Forget every sequence not in `keep` (finished, aborted or preempted)."""


class NgramProposer(Proposer):
    def __init__(self, k: int, n_min: int = 1, n_max: int = 4):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[list[int]], list[None]]:
        """Up to limits[i] tokens for each sequence, and no distributions (a point mass on each)."""
        return [self._lookup(s.token_ids, k) for s, k in zip(seqs, limits)], [None] * len(seqs)

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix (n_max down to n_min)."""
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):     # latest first: the most local context
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []


class _DraftState:
    """What the draft's block manager needs of a sequence: its draft block table and cached positions."""

    def __init__(self):
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0


class DraftModelProposer(Proposer):
    def __init__(self, model, k: int, num_kv_blocks: int, block_size: int, seed: int = 0):
        self.k, self.model = k, model
        self.blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_kv_blocks, block_size, seed)
        self.states: dict[str, _DraftState] = {}

    def release(self, keep: set[str]) -> None:
        """Free the draft blocks of sequences not in `keep` (finished, aborted, or preempted: those that
        come back are caught up from scratch)."""
        for seq_id in [s for s in self.states if s not in keep]:
            self.blocks.release(self.states.pop(seq_id))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """limits[i] drafted tokens for each sequence (sampled from the draft with the request's own
        parameters and generator) and their distributions [limits[i], V]."""
        rows = [i for i, k in enumerate(limits) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        for i in rows:
            st = self.states.setdefault(seqs[i].seq_id, _DraftState())
            if not self.blocks.ensure(st, seqs[i].num_tokens + limits[i] - 1):
                limits[i] = 0                          # the draft pool is short: no drafts this step
        rows = [i for i in rows if limits[i] > 0]
        for step in range(max((limits[i] for i in rows), default=0)):
            rows = [i for i in rows if limits[i] > step]
            states = [self.states[seqs[i].seq_id] for i in rows]
            if step == 0:    # catch up: every token the draft has not seen yet, then the first draft
                tokens = [seqs[i].token_ids[st.num_cached_tokens:] for i, st in zip(rows, states)]
            else:
                tokens = [[drafts[i][-1]] for i in rows]
            plan = StepPlan(tokens, [st.num_cached_tokens for st in states], [st.block_table for st in states],
                            list(range(len(rows))))
            logits = self.runner.forward(plan)
            for j, (i, st) in enumerate(zip(rows, states)):
                st.num_cached_tokens += len(tokens[j])
                q = probs(logits[j:j + 1], seqs[i].params)[0]
                token = int(q.argmax()) if seqs[i].params.greedy else int(
                    torch.multinomial(q, 1, generator=seqs[i].generator or self.runner.generator))
                drafts[i].append(token)
                dists[i].append(q)
        return drafts, [torch.stack(d) if d else None for d in dists]

    def accepted(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After verification: the draft's cache is right up to the last accepted draft it has seen."""
        st = self.states.get(seq.seq_id)
        if st is not None and num_drafts:
            # it saw the sequence's tokens before this step and drafts 1 .. num_drafts - 1
            seen_before = st.num_cached_tokens - (num_drafts - 1)
            st.num_cached_tokens = seen_before + min(num_accepted, num_drafts - 1)
            self.blocks.trim(st, st.num_cached_tokens + 1)
