"""Chapter 03: the engine loop. add_request -> step (schedule -> run -> update) until nothing is left.

Chapter 04: the KV cache is a pool of blocks (sized here), shared through prefix caching. For a server
(chapter 09): requests have string ids and can be aborted; every step returns a RequestOutput for each
request that advanced, with the text it added (incremental detokenizing, stop strings held back until
they are ruled out) and its times.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.tracing import STEP_SPAN, traced
from nanoserve.engine.sequence import Sequence
from nanoserve.models import CausalLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.validation import check_int, is_int


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
    compilation: str = "eager"           # or "compile" | "cudagraph": static decode steps (chapter 06)

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
            check_int(name, value)


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig,
                 runner: ModelRunner | None = None, spec=None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.spec = spec   # chapter 10: a speculative.SpeculativeDecoder, or None
        param = next(model.parameters())
        self.device = param.device
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        eos = tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_ids
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   self.block_manager, eos, config.scheduling)
        if spec is not None:   # the scheduler reserves the blocks a decode's drafts are run in
            self.scheduler.num_lookahead_slots = spec.k
        # the runner owns the KV pool; chapter 08 hands in one that also drives the other ranks
        self.runner = runner or ModelRunner(model, config.num_kv_blocks, config.block_size, config.seed,
                                            compilation=config.compilation, max_num_seqs=config.max_num_seqs,
                                            max_model_len=config.max_model_len)
        self.kv_cache = self.runner.kv_cache
        self.requests: dict[str, Sequence] = {}   # unfinished requests by id
        # prefill: prompt tokens computed for the first time; decode: generated tokens fed back, first time;
        # recomputed: tokens computed again after a preemption freed their keys/values
        self.stats = dict(steps=0, prefill_tokens=0, decode_tokens=0, recomputed_tokens=0, finished=0)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validate and queue one request; a bad one raises here and touches nothing else."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running or waiting")
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
            bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:3]!r}")
        if not ids:
            raise ValueError("prompt is empty: a request needs at least one token")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                             f"(prompt plus at least one new token)")
        if self.spec is not None and (params.logprobs is not None or params.prompt_logprobs is not None
                                      or params.adjusts_logits):
            raise ValueError("logprobs, prompt_logprobs, logit_bias, min_tokens and penalties are not supported with "
                             "speculative decoding yet")
        if params.logit_bias and max(params.logit_bias) >= self.model.config.vocab_size:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary "
                             f"[0, {self.model.config.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to see text; this engine has none: use stop_token_ids")
        decoder = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        seq = Sequence(request_id, ids, params, text, self.device, decoder)
        if params.min_tokens:
            seq.min_tokens_stop_ids = self.scheduler.stopper.stop_token_ids(params)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str | list[str]) -> None:
        """Drop requests, waiting or running: their KV blocks are freed, finish_reason "abort". Ids that
        are unknown or already finished are ignored (a client may disconnect after its last token)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        seqs = [self.requests.pop(i) for i in ids if i in self.requests]
        self.scheduler.abort(seqs, time.perf_counter())
        if self.spec is not None:
            self.spec.release(self.scheduler.running)

    @traced(STEP_SPAN)
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a batch, run it, record tokens. Returns a RequestOutput for every
        request that advanced (a new token, or finished), `finished` True for those that are done."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.perf_counter()
        for seq, n in batch:
            start, stop = seq.num_cached_tokens, seq.num_cached_tokens + n
            again = max(0, min(stop, seq.num_computed_ever) - start)
            first_prompt = max(0, min(stop, seq.num_prompt_tokens) - max(start, seq.num_computed_ever))
            self.stats["recomputed_tokens"] += again
            self.stats["prefill_tokens"] += first_prompt
            self.stats["decode_tokens"] += n - again - first_prompt
            seq.num_computed_ever = max(seq.num_computed_ever, stop)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        if self.spec is not None:   # chapter 10: decodes carry drafts; each gets its accepted ones and one more
            new_tokens, computed = self.spec.run(batch, self.runner, self.scheduler.running)
            batch = [(seq, computed.get(seq.seq_id, n)) for seq, n in batch]
        else:
            new_tokens = self.runner.run(batch)
        now = time.perf_counter()
        advanced = self.scheduler.update(batch, new_tokens, now)
        if self.spec is not None:
            self.spec.release(self.scheduler.running)
        outputs = [self._output(seq, self._new_text(seq, now)) for seq in advanced]
        for seq in advanced:
            if seq.is_finished:
                self.requests.pop(seq.seq_id, None)
                self.stats["finished"] += 1
        self.stats["steps"] += 1
        return outputs

    def _new_text(self, seq: Sequence, now: float) -> str:
        """Detokenize the token just added; cut at a stop string (finishing the request); return the text
        that can be sent now. Text that might be the start of a stop string is held back until it is not."""
        if seq.detokenizer is None:
            return ""
        seq.text += seq.detokenizer.push(seq.token_ids[seq.num_detokenized:])   # one token, or more (ch. 10)
        seq.num_detokenized = seq.num_tokens
        if seq.is_finished:
            seq.text += seq.detokenizer.flush()
        stop = self.scheduler.stopper.check_text(seq)   # cuts seq.text before the stop string
        if stop is not None and seq.finish_reason != "stop":   # also when this token reached max_tokens: the string wins
            seq.stop_reason = stop
            self.scheduler.finish(seq, "stop", now)
        hold = self.scheduler.stopper.held_back(seq)
        ready = max(seq.num_text_sent, len(seq.text) - hold)
        delta, seq.num_text_sent = seq.text[seq.num_text_sent:ready], ready
        return delta

    def _output(self, seq: Sequence, delta: str) -> RequestOutput:
        out = seq.output_token_ids
        finished = seq.is_finished
        return RequestOutput(
            request_id=seq.seq_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            outputs=[CompletionOutput(0, seq.text, out, seq.finish_reason if finished else None, delta,
                                      seq.stop_reason if finished else None,
                                      None if seq.logprobs is None else seq.logprobs[:len(out)])],
            finished=finished, metrics=request_metrics(seq),
            prompt_logprobs=None if seq.prompt_logprobs is None or seq.needs_prompt_logits else list(seq.prompt_logprobs),
            num_cached_tokens=seq.num_prefix_hit_tokens or 0)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def metrics(self) -> dict:
        s = self.scheduler
        b = self.block_manager
        return dict(num_running=len(s.running), num_waiting=len(s.waiting), max_num_seqs=self.config.max_num_seqs,
                    waiting_prompt_tokens=sum(seq.num_prompt_tokens for seq in s.waiting),
                    kv_blocks_total=b.num_blocks, kv_blocks_free=b.num_free, kv_block_size=b.block_size,
                    kv_cache_bytes=self.kv_cache.nbytes,
                    prefix_cache_hit_rate=b.hit_tokens / b.queried_tokens if b.queried_tokens else 0.0,
                    prefix_cache_hit_tokens=b.hit_tokens, prefix_cache_queried_tokens=b.queried_tokens,
                    num_preemptions=s.num_preemptions, **self.compile_metrics(), **self.stats,
                    **(self.spec.metrics() if self.spec is not None else {}))

    def running_request_ids(self) -> list[str]:
        """The requests in the running batch (those a failed step took with it)."""
        return [seq.seq_id for seq in self.scheduler.running]

    def compile_metrics(self) -> dict:
        """Chapter 06: the compilation mode, graphs compiled or captured, recompiles (a bucket compiled twice),
        the seconds compiling or capturing took, and for CUDA graphs the bytes of their memory pool."""
        compiled = getattr(self.runner, "compiled", None)
        graphs = self.config.compilation == "cudagraph" and compiled is not None
        return dict(compilation=self.config.compilation,
                    num_compiles=compiled.num_compiles if compiled else 0,
                    num_recompiles=compiled.num_recompiles if compiled else 0,
                    compile_seconds=compiled.compile_seconds if compiled else 0.0,
                    cudagraph_capture_seconds=compiled.capture_seconds if graphs else None,
                    cudagraph_memory_bytes=compiled.memory_bytes if graphs else None)


def request_metrics(seq: Sequence) -> dict:
    """A request's times (perf_counter seconds), vLLM's RequestMetrics names, plus TTFT and each token's time."""
    queued = None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
    ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
    return dict(arrival_time=seq.arrival_time, first_scheduled_time=seq.first_scheduled_time,
                first_token_time=seq.first_token_time, last_token_time=seq.token_times[-1] if seq.token_times else None,
                finished_time=seq.finish_time, time_in_queue=queued, ttft=ttft, token_times=list(seq.token_times),
                num_preemptions=seq.num_preemptions)
