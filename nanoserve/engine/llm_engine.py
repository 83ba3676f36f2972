"""Chapter 03: the engine loop. add_request -> step (schedule -> run -> update) until nothing is left.

Chapter 04: the KV cache is a pool of blocks (sized here), shared through prefix caching.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.models import CausalLM
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32               # sequences running at once
    max_num_batched_tokens: int = 2048   # tokens per step, prefill chunks and decodes together
    max_model_len: int = 1024            # prompt + output tokens of one sequence
    num_kv_blocks: int = 2048            # the KV pool (LLM sizes it from memory; see kv_pool_size)
    block_size: int = 16                 # token positions per KV block
    enable_prefix_caching: bool = True
    seed: int = 0
    scheduling: str = "continuous"       # or "static", the baseline chapter 03 measures against

    def __post_init__(self):
        self.check_positive(**{name: getattr(self, name) for name in (
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "block_size")})
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the KV pool ({self.num_kv_blocks} blocks of {self.block_size} = "
                             f"{self.num_kv_blocks * self.block_size} tokens) cannot hold one sequence of "
                             f"max_model_len = {self.max_model_len}: give more blocks or a smaller max_model_len")

    @staticmethod
    def check_positive(**values) -> None:
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: expected an int >= 1")


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        param = next(model.parameters())
        self.device = param.device
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        eos = tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_ids
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   self.block_manager, eos, config.scheduling)
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size, config.seed)  # owns the KV pool
        self.kv_cache = self.runner.kv_cache
        self._ids = itertools.count()
        # prefill: prompt tokens computed for the first time; decode: generated tokens fed back, first time;
        # recomputed: tokens computed again after a preemption freed their keys/values
        self.stats = dict(steps=0, prefill_tokens=0, decode_tokens=0, recomputed_tokens=0, finished=0)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request; a bad one raises here and touches nothing else."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine has none: pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:3]!r}")
        if not ids:
            raise ValueError("prompt is empty: a request needs at least one token")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                             f"(prompt plus at least one new token)")
        seq = Sequence(next(self._ids), ids, params, text, self.device)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One iteration: schedule a batch, run it, record tokens. Returns the sequences that finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        for seq, n in batch:
            start, stop = seq.num_cached_tokens, seq.num_cached_tokens + n
            again = max(0, min(stop, seq.num_computed_ever) - start)
            first_prompt = max(0, min(stop, seq.num_prompt_tokens) - max(start, seq.num_computed_ever))
            self.stats["recomputed_tokens"] += again
            self.stats["prefill_tokens"] += first_prompt
            self.stats["decode_tokens"] += n - again - first_prompt
            seq.num_computed_ever = max(seq.num_computed_ever, stop)
        new_tokens = self.runner.run(batch)
        finished = self.scheduler.update(batch, new_tokens, time.perf_counter())
        self.stats["steps"] += 1
        self.stats["finished"] += len(finished)
        return finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def metrics(self) -> dict:
        s = self.scheduler
        b = self.block_manager
        return dict(num_running=len(s.running), num_waiting=len(s.waiting),
                    kv_blocks_total=b.num_blocks, kv_blocks_free=b.num_free, kv_block_size=b.block_size,
                    kv_cache_bytes=self.kv_cache.nbytes,
                    prefix_cache_hit_rate=b.hit_tokens / b.queried_tokens if b.queried_tokens else 0.0,
                    prefix_cache_hit_tokens=b.hit_tokens, prefix_cache_queried_tokens=b.queried_tokens,
                    num_preemptions=s.num_preemptions, **self.stats)

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop requests (waiting or running), freeing their KV blocks; others are untouched."""
        self.scheduler.abort(seqs)
