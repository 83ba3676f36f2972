"""What the engine hands back, after vLLM's `vllm.outputs`: one RequestOutput per request per step it advanced."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log-probability under the model: the log-softmax of its raw logits (before temperature,
    top-k and top-p), and its rank in that distribution (1: the most likely token)."""
    logprob: float
    rank: int


TokenLogprobs = dict[int, Logprob]   # one position: the token there first, then the top-k others


@dataclass
class CompletionOutput:
    index: int
    text: str                      # all the text so far (stop strings and what follows them are never in it)
    token_ids: list[int]           # all the generated tokens so far
    finish_reason: str | None      # None while running; "stop" | "length" | "abort" | "error" (see RequestOutput.error)
    text_delta: str = ""           # the text this step added: what a stream sends (joined, the deltas are `text`)
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it, when one did
    logprobs: list[TokenLogprobs] | None = None   # with SamplingParams.logprobs: one per generated token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one: n > 1 (several samples per prompt) is not supported yet
    finished: bool = False
    # perf_counter seconds: arrival_time, first_scheduled_time, first_token_time, last_token_time, finished_time;
    # token_times (one per generated token: inter-token times are their differences); time_in_queue, ttft
    metrics: dict = field(default_factory=dict)
    error: str | None = None        # why this request failed (the others still ran)
    # with SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0      # prompt tokens read from the prefix cache instead of computed
