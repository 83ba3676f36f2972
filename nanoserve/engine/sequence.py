"""Chapter 03: a request's life. waiting -> running -> finished, with its tokens and its place in the cache.

Chapter 04 adds preemption (running -> waiting, to be recomputed) and the block table. For serving, a
request also keeps its text as it grows (an incremental detokenizer, so a stream can send each new
piece) and the times a server reports: arrival, first scheduled, each token, finish.
"""
from __future__ import annotations

import enum
import time

import torch

from nanoserve.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 device: torch.device | str = "cpu", detokenizer=None):
        self.seq_id = seq_id                      # the request id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)   # prompt, then each generated token
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0                # tokens whose keys/values are in the KV cache
        self.num_computed_ever = 0                # high-water mark, so recomputation after preemption shows
        self.num_prefix_hit_tokens: int | None = None   # prompt tokens the prefix cache held at first admission
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []          # KV blocks holding its positions, in order (chapter 04)
        self.block_hashes: list[bytes] = []       # prefix-cache hashes of its full, computed blocks
        self.prefix_hashes: tuple[int, list[bytes]] | None = None  # (num_tokens, hashes): BlockManager's memo
        self.finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        self.error: str | None = None             # why a request failed, when it did
        self.num_preemptions = 0
        self.generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
        self.logit_state = None   # sampling.LogitState: its biases and penalties as dense rows, once it samples
        self.min_tokens_stop_ids: set[int] = set()   # stop tokens banned until min_tokens are out (the engine's)
        self.logprobs = None if params.logprobs is None else []   # one per generated token
        # one per prompt token, the first None: nothing predicts it
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None]
        self.detokenizer = detokenizer            # tokenizer.IncrementalDecoder, or None (token ids only)
        self.text = ""                            # decoded output so far, cut at a stop string
        self.num_text_sent = 0                    # characters of `text` already handed out as deltas
        self.num_detokenized = len(prompt_token_ids)   # tokens pushed through the detokenizer
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt log-probabilities still to compute: the prompt must run through the model, not the cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, cached={self.num_cached_tokens})")
