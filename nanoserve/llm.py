"""The offline API, after vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from nanoserve import models, tokenizer as tokenizer_mod
from nanoserve.engine import EngineConfig, LLMEngine, Sequence
from nanoserve.perf import device as resolve_device
from nanoserve.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None      # "stop" | "length"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)   # arrival, first token and finish times (s, perf_counter)


class LLM:
    """An offline engine over one model.

    model: None (the shipped course model) or a Hugging Face-format directory.
    device: "auto" | "cpu" | "cuda"; dtype: "auto" | "float32" | "bfloat16" | "float16" | torch.dtype.
    max_num_seqs: sequences decoded together; max_num_batched_tokens: tokens per step;
    max_model_len: prompt + output tokens per sequence (default: the model's, capped at 2048).
    scheduling: "continuous" (default) or "static", the baseline chapter 03 compares against.
    """

    def __init__(self, model: str | None = None, device="auto", dtype="auto", max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None, seed: int = 0,
                 scheduling: str = "continuous"):
        from nanoserve import COURSE_MODEL
        path = COURSE_MODEL if model is None else model
        dev = resolve_device(device)
        self.model = models.load(path, device=dev, dtype=dtype)
        self.tokenizer = tokenizer_mod.load(path)
        cfg = self.model.config
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 2048)
        elif max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len = {max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        torch.manual_seed(seed)
        self.engine = LLMEngine(self.model, self.tokenizer, EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, seed=seed, scheduling=scheduling))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        prompts: a str, a list of str, or a list of token-id lists. sampling_params: one for all, or one per prompt.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        # validate everything before queueing anything: a bad prompt fails the call, not half a batch
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(p, (str, list, tuple)):
                raise TypeError(f"prompts[{i}] must be a str or a list of token ids, got {type(p).__name__}")
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        seqs, queued = [], []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                try:
                    seq = self.engine.add_request(p, sp)
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
                queued.append(seq)
            seqs = queued
        except Exception:
            self.engine.abort(queued)
            raise
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm, unit="req")
        while any(not s.is_finished for s in seqs):
            bar.update(len(self.engine.step()))
        bar.close()
        return [self._output(s) for s in seqs]

    def _output(self, seq: Sequence) -> RequestOutput:
        out = seq.output_token_ids
        return RequestOutput(
            request_id=seq.seq_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            outputs=[CompletionOutput(0, self.tokenizer.decode(out), out, seq.finish_reason)],
            metrics=dict(arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                         finish_time=seq.finish_time))

    def metrics(self) -> dict:
        """Engine counters: running/waiting requests, KV cache slots, steps, prefill and decode tokens."""
        return self.engine.metrics()
