"""Chapter 10: a speculative step inside the continuous-batching engine.

The scheduler's batch is taken as it is (prefill chunks, decodes). Each decode may carry up to k proposed
tokens, if the step's token budget, the request's max_tokens and the model's length allow, and within the
blocks the scheduler reserved for them (`Scheduler.reserve_lookahead`: this module never allocates the
target's blocks). The target then runs `[last token, d_1 .. d_k]` for it, a short prefill chunk, and returns
logits at all k + 1 positions. `verify` keeps the accepted prefix and adds one token. The keys and values
written for rejected drafts lie past the sequence's cached length, where nothing reads them, and the blocks
that hold only such positions go back to the pool (`BlockManager.trim`, in `Scheduler.update`).
"""
from __future__ import annotations

import torch

from nanoserve.engine.model_runner import StepPlan
from nanoserve.sampling import probs, sample
from nanoserve.speculative.proposers import Proposer
from nanoserve.speculative.verify import verify


class SpeculativeDecoder:
    def __init__(self, proposer: Proposer, k: int, max_num_batched_tokens: int, max_model_len: int):
        self.proposer, self.k = proposer, k
        self.max_num_batched_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        # vLLM's names: proposals made, tokens proposed, tokens accepted, and accepted at each position
        self.stats = dict(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                          spec_decode_num_accepted_tokens=0)
        self.accepted_per_pos = [0] * k

    def metrics(self) -> dict:
        s = self.stats
        return s | dict(spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos),
                        spec_decode_acceptance_rate=(s["spec_decode_num_accepted_tokens"] /
                                                     s["spec_decode_num_draft_tokens"])
                        if s["spec_decode_num_draft_tokens"] else 0.0)

    def limits(self, batch, block_size: int) -> list[int]:
        """How many drafts each row may carry: 0 for prefill chunks; for decodes, within k, the tokens the
        request may still produce, the model's length, the positions its blocks hold past its next token
        (what the scheduler reserved) and what is left of the step's token budget."""
        budget = self.max_num_batched_tokens - sum(n for _, n in batch)
        out = []
        for seq, n in batch:
            decoding = n == 1 and seq.num_cached_tokens + 1 == seq.num_tokens
            room = min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1,
                       len(seq.block_table) * block_size - seq.num_tokens, budget) if decoding else 0
            out.append(max(room, 0))
            budget -= out[-1]
        return out

    @torch.inference_mode()
    def run(self, batch, runner, running) -> tuple[dict, dict]:
        """Propose, verify and sample one step. Returns ({seq_id: [new tokens]}, {seq_id: positions
        computed}) for the rows that sampled; the second is what `Scheduler.update` adds to the cache."""
        self.release(running)             # preempted since the last step
        seqs = [seq for seq, _ in batch]
        drafts, dists = self.proposer.propose(seqs, self.limits(batch, runner.kv_cache.block_size))
        plan = StepPlan.of(batch)
        for i, d in enumerate(drafts):
            if d:
                plan.token_ids[i] = plan.token_ids[i] + d
        num_logits = [1 + len(drafts[i]) for i in plan.sample_rows]
        # a step where no row carries drafts is a plain step: it may take the compiled / CUDA-graph path
        logits = runner.forward(plan, num_logits if any(drafts) else None)
        if logits is None:
            return {}, {}
        rows = torch.split(logits, num_logits)
        new_tokens, computed, plain = {}, {}, []
        for r, i in enumerate(plan.sample_rows):
            seq = seqs[i]
            if not drafts[i]:
                plain.append((seq, rows[r]))
                continue
            p = probs(rows[r], seq.params)
            tokens, accepted = verify(p, drafts[i], dists[i], seq.params, seq.generator or runner.generator)
            if not (0 <= accepted <= len(drafts[i]) and len(tokens) == accepted + 1
                    and tokens[:accepted] == drafts[i][:accepted]):   # a broken rule must not stall a request
                raise ValueError(f"verify returned {tokens} with {accepted} accepted for drafts {drafts[i]}: expected "
                                 f"the accepted drafts, then exactly one more token")
            new_tokens[seq.seq_id], computed[seq.seq_id] = tokens, 1 + accepted
            self._count(len(drafts[i]), accepted)
            self.proposer.accepted(seq, len(drafts[i]), accepted)
        if plain:
            sampled = sample(torch.cat([row for _, row in plain]), [s.params for s, _ in plain],
                             [s.generator for s, _ in plain], runner.generator).tolist()
            for (seq, _), token in zip(plain, sampled):
                new_tokens[seq.seq_id] = [token]
        return new_tokens, computed

    def release(self, running) -> None:
        """Let the proposer drop what it holds for sequences no longer running (finished, aborted, preempted)."""
        self.proposer.release({s.seq_id for s in running})

    def _count(self, num_drafts: int, accepted: int) -> None:
        self.stats["spec_decode_num_drafts"] += 1
        self.stats["spec_decode_num_draft_tokens"] += num_drafts
        self.stats["spec_decode_num_accepted_tokens"] += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1
