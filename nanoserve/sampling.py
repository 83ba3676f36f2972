"""Chapter 02: choosing the next token. Greedy, temperature, top-k, top-p, per-request seeds.

Chapter 09's server adds what OpenAI's and vLLM's APIs let a request ask for (`adjust_logits`): a bias per
token, a ban on stop tokens until `min_tokens` are out, and penalties on tokens already used; and `min_p`.

`SamplingParams` mirrors vLLM's offline API. `sample()` handles a batch whose rows each have their
own parameters: one vectorised pass for the shared work, a per-row random draw only where a request
brought its own seed (so a seeded request gives the same tokens whatever else is in the batch).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from nanoserve.outputs import Logprob, TokenLogprobs
from nanoserve.validation import FieldError, check_int, is_int, is_number

MAX_LOGPROBS = 20   # the most top-k log-probabilities a position returns (vLLM's and OpenAI's limit)


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names)."""
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0            # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1               # keep the k most likely tokens; -1 (or 0) = all
    max_tokens: int = 16          # new tokens at most
    ignore_eos: bool = False      # keep going past EOS (benchmarks use it for fixed output lengths)
    stop_token_ids: list[int] | None = field(default=None)
    seed: int | None = None       # same seed, same tokens
    stop: list[str] | None = field(default=None)   # stop strings: generation ends before the first one (not in the text)
    logprobs: int | None = None          # return each generated token's log-probability and the top-k (0..20)
    prompt_logprobs: int | None = None   # the same for every prompt token (the prompt is then computed, not cached)
    min_p: float = 0.0                   # drop tokens less likely than min_p x the most likely one's probability
    presence_penalty: float = 0.0        # subtracted from the logit of every token already generated (-2..2)
    frequency_penalty: float = 0.0       # ... times how often it was generated (-2..2)
    repetition_penalty: float = 1.0      # a logit of a token in the prompt or output: / it if > 0, else x it
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (-100..100)
    min_tokens: int = 0                  # stop tokens (EOS, stop_token_ids) and stop strings wait until this many
    n: int = 1                           # samples of the prompt, each its own sequence (see `child`)

    def __post_init__(self):
        def bad(name, value, expected):
            raise FieldError(name, value, expected, owner="SamplingParams.")
        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            bad("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", self.top_k, "-1 or 0 (disabled) or a positive int")
        check_int("max_tokens", self.max_tokens, owner="SamplingParams.")
        check_int("n", self.n, owner="SamplingParams.")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**64):   # torch.Generator
            bad("seed", self.seed, "an int in [-2**63, 2**64) or None")
        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids)
            if not all(is_int(t) and t >= 0 for t in ids):
                bad("stop_token_ids", self.stop_token_ids, "a list of non-negative ints")
            self.stop_token_ids = ids
        if self.stop is not None:
            stop = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
                bad("stop", self.stop, "a non-empty str or a list of non-empty str")
            self.stop = list(stop)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                bad(name, k, f"an int in [0, {MAX_LOGPROBS}] or None")
        for name, low, high in (("min_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
            if not is_number(getattr(self, name)) or not low <= getattr(self, name) <= high:
                bad(name, getattr(self, name), f"a number in [{low}, {high}]")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 means none)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
                bad("logit_bias", self.logit_bias, "a dict of token id (int >= 0) -> bias in [-100, 100]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"an int in [0, max_tokens = {self.max_tokens}]")
        self.min_p = float(self.min_p)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child(self, index: int) -> "SamplingParams":
        """The params of sample `index` of n: one sample, and with a seed its own (seed + index), so each of the n
        differs and all are reproducible. The n children share the prompt's KV blocks through the prefix cache."""
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def penalizes(self) -> bool:
        """A repetition, presence or frequency penalty: the logits depend on the tokens generated so far."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)

    @property
    def adjusts_logits(self) -> bool:
        """A bias, min_tokens or a penalty: the logits need `adjust_logits`."""
        return bool(self.logit_bias or self.min_tokens or self.penalizes)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                  outputs: list[list[int]], stop_ids: list[set[int]]) -> torch.Tensor:
    """Row i of logits [B, V] for params[i], given its prompt and output tokens so far, in vLLM's order:
    the logit bias; the stop tokens stop_ids[i] banned while fewer than min_tokens are out; then the
    repetition, frequency and presence penalties. Returns a new tensor (log-probabilities read the raw logits)."""
    out = logits.clone()
    V, dev = logits.shape[-1], logits.device
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        row = out[i]
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < V]
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], device=dev, dtype=row.dtype)
        if len(output) < p.min_tokens and stop_ids[i]:
            row[[t for t in stop_ids[i] if t < V]] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), device=dev, dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output:
            counts = torch.bincount(torch.tensor(output, device=dev), minlength=V)[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


class LogitState:
    """One sequence's logit adjustments as dense rows over the vocabulary, built at its first sampled token and
    brought up to date with the tokens added since, so a step's work does not grow with the prompt or the
    output (what `adjust_logits` redoes from the token lists for every row at every step)."""

    def __init__(self, params: SamplingParams, prompt: list[int], stop_ids: set[int], vocab: int, device):
        self.bias = torch.zeros(vocab, device=device)
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            self.bias[ids] = torch.tensor([params.logit_bias[t] for t in ids], device=device)
        self.banned = torch.zeros(vocab, dtype=torch.bool, device=device)   # stop tokens, before min_tokens
        self.banned[[t for t in stop_ids if t < vocab]] = True
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1.0 and prompt:
            self.in_prompt[torch.tensor(prompt, device=device)] = True
        self.counts = torch.zeros(vocab, device=device)    # how often each token is in the output so far
        self.counted = 0

    def catch_up(self, output: list[int]) -> None:
        """Count the output tokens added since the last call (only penalties read the counts)."""
        if len(output) > self.counted:
            new = torch.tensor(output[self.counted:], device=self.counts.device)
            self.counts.index_put_((new,), torch.ones_like(new, dtype=self.counts.dtype), accumulate=True)
            self.counted = len(output)


def adjust_logits_batched(logits: torch.Tensor, params: list[SamplingParams], states: list[LogitState],
                          num_outputs: list[int]) -> torch.Tensor:
    """`adjust_logits` for the whole batch at once, from each row's LogitState (up to date where its request
    has a penalty): the same arithmetic in the same order, on [B, V] tensors, so the result is equal to the
    per-row one. A rule no row asks for is skipped (for the others it is the identity): each one costs a few
    operations over the whole batch's logits, host work between two forwards."""
    dev = logits.device
    column = lambda values: torch.tensor(values, device=dev, dtype=logits.dtype)[:, None]
    rows = lambda name: torch.stack([getattr(s, name) for s in states])
    out = logits
    if any(p.logit_bias for p in params):
        out = out + rows("bias")
    early = [n < p.min_tokens for n, p in zip(num_outputs, params)]
    if any(early):
        out = out.masked_fill(torch.tensor(early, device=dev)[:, None] & rows("banned"), float("-inf"))
    repeats = any(p.repetition_penalty != 1.0 for p in params)
    counted = any(p.frequency_penalty or p.presence_penalty for p in params)
    if repeats or counted:
        counts = rows("counts")
    if repeats:
        rep = column([p.repetition_penalty for p in params])
        seen = (rows("in_prompt") | (counts > 0)) & (rep != 1.0)
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    if counted:
        out = out - (column([p.frequency_penalty for p in params]) * counts
                     + column([p.presence_penalty for p in params]) * (counts > 0).to(out.dtype))
    return out if out is not logits else logits.clone()


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p set. logits [B, V]; top_k, top_p [B]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = rank[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # drop a token when the tokens before it already reach top_p (the first token always stays).
    # Rows with top_p == 1 keep everything: fp32 cumsum can round to 1.0 before the tail.
    drop |= ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probs(logits: torch.Tensor, params: SamplingParams | list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of logits [B, V] (fp32) is drawn from: temperature, then top-k and top-p, then
    softmax. params: one for every row, or one per row; a greedy row is a point mass on its argmax. Sampling,
    speculative verification and the draft model all read their distributions here."""
    rows = [params] * logits.shape[0] if isinstance(params, SamplingParams) else list(params)
    if len(rows) != logits.shape[0]:
        raise ValueError(f"probs: {logits.shape[0]} rows of logits but {len(rows)} SamplingParams")
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in rows], device=dev)
    scaled = logits / temp[:, None]
    if any(p.min_p > 0 for p in rows):   # below min_p x the top token's probability: out
        min_p = torch.tensor([p.min_p for p in rows], device=dev)
        p = scaled.softmax(-1)
        low = p < min_p[:, None] * p.amax(-1, keepdim=True)
        scaled = scaled.masked_fill(low, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1 for p in rows):
        scaled = filter_logits(scaled, torch.tensor([p.top_k for p in rows], device=dev),
                               torch.tensor([p.top_p for p in rows], device=dev))
    out = scaled.softmax(-1)
    greedy = [i for i, p in enumerate(rows) if p.greedy]
    if greedy:
        out[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(-1), logits.shape[-1]).to(out.dtype)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None,
           default_generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [B, V] (fp32), row i drawn with params[i] (and generators[i] if given)."""
    B = logits.shape[0]
    if len(params) != B:
        raise ValueError(f"sample: {B} rows of logits but {len(params)} SamplingParams")
    greedy_tokens = logits.argmax(-1)
    if all(p.greedy for p in params):
        return greedy_tokens
    dev = logits.device
    p = probs(logits, params)
    # Draw via the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
    noise = torch.empty_like(p)
    generators = generators or [None] * B
    shared = [i for i in range(B) if generators[i] is None]
    if shared:
        noise[shared] = torch.empty(len(shared), p.shape[1], device=dev).exponential_(generator=default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.empty(p.shape[1], device=dev).exponential_(generator=g)
    # a draw of exactly 0 would make p / 0 = inf, or nan for a filtered token (0 / 0): keep E > 0
    sampled = (p / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)
    is_greedy = torch.tensor([q.greedy for q in params], device=dev)
    return torch.where(is_greedy, greedy_tokens, sampled)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_k: list[int]) -> list[TokenLogprobs]:
    """For each row of logits [B, V]: the log-probability and rank of token_ids[row], then the row's top_k[row]
    most likely tokens, from the log-softmax of the raw logits (what OpenAI's and vLLM's `logprobs` report)."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    k = max(top_k)
    top = logp.topk(k, dim=-1) if k else None
    out = []
    for i, token in enumerate(token_ids):
        entry = {token: Logprob(float(chosen[i, 0]), ranks[i])}
        if top is not None:
            for r, (value, tid) in enumerate(zip(top.values[i, :top_k[i]].tolist(), top.indices[i, :top_k[i]].tolist())):
                entry.setdefault(tid, Logprob(value, r + 1))
        out.append(entry)
    return out
