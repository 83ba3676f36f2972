"""Chapter 03: continuous (iteration-level) batching. Chapter 04: within a pool of KV blocks.

Every step the scheduler builds a new batch: running sequences first (one token each for decodes, the
next chunk for a prompt still being prefilled), then waiting requests admitted while there is room
under `max_num_seqs`, tokens left in the step's budget and KV blocks for what they will compute. A
finished sequence leaves at once and its blocks go to the next request, instead of idling until the
longest request in a static batch is done.

When a running sequence needs a block and none is free, the most recently admitted running sequence
is *preempted*: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt and the tokens it already produced) when memory allows. Nothing is lost, and its output is
the same as without the pressure.
"""
from __future__ import annotations

from collections import deque

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, Status
from nanoserve.engine.stopping import StopChecker


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_manager: BlockManager, eos_token_ids: tuple[int, ...] = (), policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduling policy {policy!r}: expected 'continuous' or 'static'")
        self.policy = policy  # "static": a batch is admitted together and no one joins until all of it is done
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stopper = StopChecker(eos_token_ids, max_model_len)   # its stop tokens and length (stop strings: the engine)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.blocks = block_manager
        # chapter 10: positions past its next token that a decode may also run (a speculative step's drafts)
        self.num_lookahead_slots = 0
        self.num_preemptions = 0
        self.defer_shared_prefixes = True   # cache-aware admission (below); False: plain first come, first served
        self.num_deferred = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of its tokens to run), within the token budget."""
        batch, budget, preempted = self.schedule_running(self.max_num_batched_tokens)
        # admit only when nothing had to give way this step: memory is tight, let the running finish
        if not preempted and (self.policy == "continuous" or not self.running):
            batch += self.admit(budget)
        if self.num_lookahead_slots:
            self.reserve_lookahead(batch)
        return batch

    def reserve_lookahead(self, batch: list[tuple[Sequence, int]]) -> None:
        """Chapter 10: blocks for up to num_lookahead_slots positions past each decode's next token, where
        the pool has them after everyone's next token and every admission (no one is preempted for a draft).
        What the drafts do not fill goes back in `update`; a decode's drafts never go past its blocks."""
        for seq, n in batch:
            if n == 1 and seq.num_cached_tokens + 1 == seq.num_tokens:
                self.blocks.ensure(seq, seq.num_cached_tokens + 1 + self.num_lookahead_slots)

    def schedule_running(self, budget: int) -> tuple[list[tuple[Sequence, int]], int, bool]:
        """The running sequences' part of the step, preempting the latest admitted when blocks run out.
        Returns (their batch entries, the token budget left, whether anyone was preempted)."""
        batch = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:      # preempted below to make room for an earlier one
                continue
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)
            if n <= 0:
                break
            while not self.blocks.ensure(seq, seq.num_cached_tokens + n):
                self.preempt(self.running[-1])         # the latest admitted gives way
                preempted = True
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is Status.RUNNING:
                batch.append((seq, n))
                budget -= n
        return batch, budget, preempted

    def admit(self, budget: int) -> list[tuple[Sequence, int]]:
        """Waiting requests that join the running batch this step, first come first served, while there is
        room under max_num_seqs, tokens left in `budget` and KV blocks for what they compute now."""
        batch = []
        computing = self._blocks_being_computed() if self.defer_shared_prefixes else set()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[i]
            if self.policy == "continuous" and self.blocks.first_missing_block(seq) in computing:
                i += 1                 # its next block is being computed by another request: follow it next step
                self.num_deferred += 1
                continue
            hit = self.blocks.match_prefix(seq)       # cached blocks at the start of its tokens: skip them
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)  # a long prompt is prefilled in chunks
            if not self.blocks.ensure(seq, seq.num_cached_tokens + n):
                self.blocks.release(seq)
                break
            self.blocks.record_admission(seq, hit)
            del self.waiting[i]
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
            if self.defer_shared_prefixes:
                computing.update(self.blocks.prefix_hashes(seq)[len(seq.block_hashes):])
        return batch

    def _blocks_being_computed(self) -> set[bytes]:
        """Prefix blocks that running prompts will compute but have not yet: a waiting request that needs one
        of them next would compute it a second time if admitted now, or hit the cache if admitted after.

        This is cache-aware admission (as SGLang's scheduler does it): requests that arrive together with a
        shared prefix let one of them compute it, and follow one step later. A deferred request never waits
        for long: once the block is computed (or its computing request leaves), it is no longer in this set.
        """
        computing = set()
        for seq in self.running:
            if seq.num_cached_tokens < seq.num_prompt_tokens:
                computing.update(self.blocks.prefix_hashes(seq)[len(seq.block_hashes):])
        return computing

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and requeue it first in line; it will be recomputed from its tokens."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: list[tuple[Sequence, int]], new_tokens: dict[int, list[int]], now: float) -> list[Sequence]:
        """Record what the step computed and sampled; retire sequences that hit a stop token or their
        length. Returns every sequence that got a new token (finished or not)."""
        advanced = []
        for seq, n in batch:
            seq.num_cached_tokens += n
            tokens = new_tokens.get(seq.seq_id)
            if tokens is None:                 # a prompt chunk that did not reach the end: nothing sampled
                self.blocks.commit_full_blocks(seq)
                continue
            reason = None
            for token in tokens:               # one, or several: accepted drafts and the next token (ch. 10)
                seq.token_ids.append(token)
                seq.token_times.append(now)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self.stopper.check_token(seq, token)
                if reason:
                    break
            self.blocks.commit_full_blocks(seq)
            if reason:
                self.finish(seq, reason, now)
            else:   # rejected drafts may have left blocks with none of its tokens: back to the pool
                self.blocks.trim(seq, seq.num_tokens)
            advanced.append(seq)
        return advanced

    def finish(self, seq: Sequence, reason: str, now: float) -> None:
        """Retire `seq` wherever it is (waiting or running): its blocks go back to the pool."""
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.release(seq)
        seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, now

    def abort(self, seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            if not seq.is_finished:
                self.finish(seq, "abort", now)
