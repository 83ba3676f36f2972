"""Chapter 03: continuous (iteration-level) batching.

Every step the scheduler builds a new batch: running sequences first (one token each for decodes, the
next chunk for a prompt still being prefilled), then waiting requests admitted while there is a free
cache slot, room under `max_num_seqs` and tokens left in the step's budget. A finished sequence leaves
at once and its slot goes to the next request, instead of idling until the longest request in a static
batch is done.
"""
from __future__ import annotations

from collections import deque

from nanoserve.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduling policy {policy!r}: expected 'continuous' or 'static'")
        self.policy = policy  # "static": a batch is admitted together and no one joins until all of it is done
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of its tokens to run), within the token budget."""
        budget = self.max_num_batched_tokens
        batch = []
        for seq in self.running:
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)
            if n <= 0:
                break
            batch.append((seq, n))
            budget -= n
        admitting = self.policy == "continuous" or not self.running
        while admitting and self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.free_slots.pop(), Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)  # a long prompt is prefilled in chunks
            batch.append((seq, n))
            budget -= n
        return batch

    def update(self, batch: list[tuple[Sequence, int]], new_tokens: dict[int, int], now: float) -> list[Sequence]:
        """Record what the step computed and sampled; retire sequences that are done. Returns those."""
        finished = []
        for seq, n in batch:
            seq.num_cached_tokens += n
            if seq.seq_id not in new_tokens:   # a prompt chunk that did not reach the end: nothing sampled
                continue
            token = new_tokens[seq.seq_id]
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self.stop_reason(seq, token)
            if reason:
                seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, now
                self.running.remove(seq)
                self.free_slots.append(seq.slot)
                seq.slot = None
                finished.append(seq)
        return finished

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.status is Status.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
            elif seq.status is Status.RUNNING:
                self.running.remove(seq)
                self.free_slots.append(seq.slot)
                seq.slot = None
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
