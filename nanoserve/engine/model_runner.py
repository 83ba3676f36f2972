"""Chapter 03: run one scheduled step on the model. Build the step's inputs, forward, sample.

The runner owns what the model reads besides its weights: the KV block pool (chapter 04) and the
attention layer over it, with the kernels chosen once for this engine (chapter 05). Each step's
metadata is built once, with tensor ops on the device (`attention.StepInputs`), and shared by every layer.

Chapter 08: `forward` takes the step as plain lists (`StepPlan`), so a tensor-parallel worker, which
holds a shard of the model and no requests, runs exactly the forward that rank 0 runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoserve import kernels
from nanoserve.attention import PagedAttention, PagedKVCache, StepInputs
from nanoserve.engine.sequence import Sequence
from nanoserve.models import CausalLM
from nanoserve.engine.tracing import FORWARD_SPAN, traced
from nanoserve.sampling import LogitState, adjust_logits_batched, sample, token_logprobs


@dataclass
class StepPlan:
    """One step as plain data: what every rank needs to run the forward (and nothing about requests)."""
    token_ids: list[list[int]]     # each sequence's new tokens this step
    starts: list[int]              # each sequence's tokens already cached
    block_tables: list[list[int]]
    sample_rows: list[int]         # which sequences sample a token (a prompt chunk that stops short does not)
    # (sequence, offset in its new tokens) whose logits score the next prompt token (prompt_logprobs)
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: list[tuple[Sequence, int]]) -> "StepPlan":
        prompt_rows = []
        for i, (s, n) in enumerate(batch):
            if s.needs_prompt_logits:   # the logits at position p score prompt token p + 1 not yet scored
                start, first = s.num_cached_tokens, len(s.prompt_logprobs) - 1
                prompt_rows += [(i, p - start) for p in range(max(first, start), min(start + n, s.num_prompt_tokens - 1))]
        return cls([s.token_ids[s.num_cached_tokens:s.num_cached_tokens + n] for s, n in batch],
                   [s.num_cached_tokens for s, _ in batch], [s.block_table for s, _ in batch],
                   [i for i, (s, n) in enumerate(batch) if s.num_cached_tokens + n == s.num_tokens], prompt_rows)


class ModelRunner:
    def __init__(self, model: CausalLM, num_kv_blocks: int, block_size: int, seed: int = 0,
                 kernel_backend: str | None = None, compilation: str = "eager", max_num_seqs: int = 32,
                 max_model_len: int | None = None):
        param = next(model.parameters())
        self.model, self.device = model, param.device
        self.ops = kernels.select(kernel_backend, self.device)   # once: NANOSERVE_KERNELS or the argument
        model.use_kernels(self.ops)
        model.model.rotary_emb.materialize(self.device)   # before any step is compiled or captured
        # chapter 06: a static decode path pads its batches with rows that write into one extra, unowned block
        extra = 0 if compilation == "eager" else 1
        self.kv_cache = PagedKVCache(model.config, num_kv_blocks + extra, block_size, param.device, param.dtype)
        self.compiled = None      # chapter 06: decode steps through torch.compile or CUDA graphs
        if compilation == "compile":
            from nanoserve.engine.compiled_decode import CompiledDecode
            self.compiled = CompiledDecode(model, self.kv_cache, max_num_seqs, scratch_block=num_kv_blocks)
        elif compilation == "cudagraph":
            from nanoserve.engine.cuda_graphs import CudaGraphDecode
            self.compiled = CudaGraphDecode(model, self.kv_cache, self.ops, max_num_seqs,
                                            max_model_len or num_kv_blocks * block_size, scratch_block=num_kv_blocks)
        self.attention = PagedAttention(self.kv_cache, model.config, self.ops)
        self.inputs = StepInputs(block_size, self.device)
        self.generator = torch.Generator(self.device).manual_seed(seed)  # for requests without their own seed

    @traced(FORWARD_SPAN)
    @torch.inference_mode()
    def forward(self, plan: StepPlan, num_logits: list[int] | None = None) -> torch.Tensor | None:
        """Forward the step's new tokens; the fp32 logits of the rows that sample, then of plan.prompt_rows, or
        None if there are none. num_logits (chapter 10): for each sampling row, logits at its last m tokens
        instead of its last one (the target scoring k drafts), concatenated in row order."""
        if (num_logits is None and self.compiled is not None and self.compiled.accepts(plan)
                and len(plan.sample_rows) == len(plan.token_ids) and not plan.prompt_rows):
            return self.compiled.forward(plan)     # a decode step: its bucket's graph (every row samples)
        ids, meta = self.inputs.build(plan.token_ids, plan.starts, plan.block_tables)
        with self.attention.step(meta):
            hidden = self.model.hidden_states(ids, meta.positions[None], self.attention)[0]
        if not plan.sample_rows and not plan.prompt_rows:
            return None
        counts = num_logits or [1] * len(plan.sample_rows)
        last = meta.last_tokens
        rows = [last[i] - m + 1 + j for i, m in zip(plan.sample_rows, counts) for j in range(m)]
        rows += [last[i] - len(plan.token_ids[i]) + 1 + k for i, k in plan.prompt_rows]
        return self.model.lm_head(hidden[rows]).float()  # the head only where logits are wanted

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Forward the batch's new tokens; return {seq_id: [sampled token]} for sequences that reached their end
        (a list, as speculative decoding's steps return: one token here, the accepted drafts and one more there)."""
        plan = StepPlan.of(batch)
        logits = self.forward(plan)
        if logits is None:
            return {}
        logits, prompt_logits = logits[:len(plan.sample_rows)], logits[len(plan.sample_rows):]
        if plan.prompt_rows:
            record_prompt_logprobs(batch, plan, prompt_logits)
        sampled = [batch[i][0] for i in plan.sample_rows]
        tokens = sample(self.adjusted(logits, sampled), [s.params for s in sampled], [s.generator for s in sampled],
                        self.generator).tolist()
        wanted = [r for r, s in enumerate(sampled) if s.logprobs is not None]
        if wanted:   # the scheduler appends each sampled token this step: its log-probabilities go beside it
            scored = token_logprobs(logits[wanted], [tokens[r] for r in wanted], [sampled[r].params.logprobs for r in wanted])
            for r, entry in zip(wanted, scored):
                sampled[r].logprobs.append(entry)
        return {s.seq_id: [t] for s, t in zip(sampled, tokens)}


    def adjusted(self, logits: torch.Tensor, sampled: list[Sequence]) -> torch.Tensor:
        """The logits to draw from: biases, min_tokens and penalties applied on a copy (logprobs read the raw).
        Each sequence keeps its adjustments as dense rows (sampling.LogitState), brought up to date with its new
        tokens, and the batch's are applied in one set of tensor operations: rebuilding each row from its token
        lists (`sampling.adjust_logits`, the reference) costs host work that grows with the prompt, every step."""
        if not any(s.params.adjusts_logits for s in sampled):
            return logits
        params, outputs = [s.params for s in sampled], [s.output_token_ids for s in sampled]
        for s, out in zip(sampled, outputs):
            if s.logit_state is None:
                s.logit_state = LogitState(s.params, s.token_ids[:s.num_prompt_tokens], s.min_tokens_stop_ids,
                                           logits.shape[-1], logits.device)
            if s.params.penalizes:
                s.logit_state.catch_up(out)
        return adjust_logits_batched(logits, params, [s.logit_state for s in sampled], [len(o) for o in outputs])


def record_prompt_logprobs(batch: list[tuple[Sequence, int]], plan: StepPlan, logits: torch.Tensor) -> None:
    """Score the prompt tokens that plan.prompt_rows predict, in order, onto each sequence's prompt_logprobs."""
    seqs = [batch[i][0] for i, _ in plan.prompt_rows]
    targets = [s.token_ids[s.num_cached_tokens + k + 1] for s, (_, k) in zip(seqs, plan.prompt_rows)]
    for s, entry in zip(seqs, token_logprobs(logits, targets, [s.params.prompt_logprobs for s in seqs])):
        s.prompt_logprobs.append(entry)


@torch.inference_mode()
def profile_activation_peak(model, num_tokens: int, num_sampled: int) -> int:
    """Peak bytes a forward of the largest step allocates beyond what is already held (weights): a
    prefill of `num_tokens` tokens, the head on `num_sampled` rows, as the engine runs it."""
    dev = next(model.parameters()).device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    ids = torch.zeros(1, num_tokens, dtype=torch.long, device=dev)
    hidden = model.hidden_states(ids)[0]
    model.lm_head(hidden[-min(num_sampled, num_tokens):]).float().softmax(-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del ids, hidden
    torch.cuda.empty_cache()
    return peak
