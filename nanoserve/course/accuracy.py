"""What quantization costs in accuracy, measured on the course model against its own fp32 run.

    rows = accuracy_table(["fp32", "bf16", "int8", "int4-g32", "int4-g128"])

Three measures, from cheap to what a user sees:
- bits per byte of held-out text (the standard library files the course model never trained on):
  the model's average surprise, per byte so that it does not depend on the tokenizer;
- the largest logit error against fp32 over the same windows, and how often the top-1 token agrees;
- greedy agreement: N prompts decoded greedily for T tokens; the share of prompts whose continuation is
  identical to fp32's, and the share of tokens before the first divergence.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

VARIANTS = ("fp32", "bf16", "int8", "int4-g32", "int4-g128")


def variant(model, name: str, backend: str | None = None):
    """A copy of fp32 `model` as `name`: "fp32", "bf16" (every weight in bf16), or a quantization scheme."""
    from nanoserve import quant
    m = copy.deepcopy(model)
    if name == "fp32":
        return m
    if name == "bf16":
        return m.to(torch.bfloat16)
    return quant.quantize_model(m, name, backend=backend)


def heldout_windows(tokenizer, n_windows: int = 32, seq_len: int = 256, max_bytes: int = 400_000):
    """(ids LongTensor [n_windows, seq_len + 1], bytes per token) from the course corpus' held-out files,
    evenly spaced over the text."""
    from nanoserve.course.corpus import heldout_text
    text = heldout_text(max_bytes)
    ids = tokenizer.encode(text)
    if len(ids) < seq_len + 1:
        raise ValueError(f"the held-out text gives {len(ids)} tokens, fewer than one window of {seq_len + 1}")
    starts = torch.linspace(0, len(ids) - seq_len - 1, n_windows).long().tolist()
    windows = torch.tensor([ids[s:s + seq_len + 1] for s in starts])
    return windows, len(text.encode()) / len(ids)


@torch.inference_mode()
def score(model, windows: torch.Tensor, bytes_per_token: float, reference_logits: torch.Tensor | None = None,
          batch_size: int = 8) -> tuple[dict, torch.Tensor]:
    """(measures, logits) of `model` over `windows`: bits per byte, and against `reference_logits` if given
    the max |logit error| and the top-1 agreement rate."""
    logits = torch.cat([model(windows[i:i + batch_size, :-1]).float() for i in range(0, len(windows), batch_size)])
    nats = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    out = dict(bits_per_byte=nats / math.log(2) / bytes_per_token)
    if reference_logits is not None:
        out["max_logit_error"] = (logits - reference_logits).abs().max().item()
        out["top1_agreement"] = (logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item()
    return out, logits


@torch.inference_mode()
def greedy_tokens(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts` from the engine (all decoded together, eager)."""
    from nanoserve.engine import EngineConfig, LLMEngine
    from nanoserve.sampling import SamplingParams
    longest = max(map(len, prompts)) + max_tokens + 1
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=len(prompts), max_model_len=longest,
                                                 num_kv_blocks=len(prompts) * -(-longest // 16)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def greedy_agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of continuations identical to the reference's, and share of tokens before the first divergence."""
    same, prefix = 0, 0
    for a, b in zip(tokens, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        prefix += n / len(b)
    return dict(identical_rate=same / len(reference), matched_prefix=prefix / len(reference))


def accuracy_table(variants=VARIANTS, model=None, tokenizer=None, n_windows: int = 16, seq_len: int = 256,
                   n_prompts: int = 16, prompt_len: int = 32, max_tokens: int = 32) -> list[dict]:
    """One row per variant of the course model (default: the shipped one, fp32 on the CPU): bits per byte,
    max logit error and top-1 agreement against fp32, greedy agreement over `n_prompts` held-out prompts.
    The fp32 row is the reference (its errors are 0, its agreement 1)."""
    from nanoserve import models, tokenizer as tokenizer_mod
    from nanoserve.models.shipped import COURSE_MODEL
    if model is None:
        model = models.load(COURSE_MODEL, device="cpu", dtype=torch.float32)
        tokenizer = tokenizer_mod.load(COURSE_MODEL)
    windows, bpt = heldout_windows(tokenizer, n_windows, seq_len)
    # greedy prompts: the first prompt_len tokens of evenly spaced held-out windows
    prompts = [w[:prompt_len].tolist() for w in windows[:: max(1, len(windows) // n_prompts)][:n_prompts]]
    ref_measures, ref_logits = score(model, windows, bpt)
    ref_tokens = greedy_tokens(model, prompts, max_tokens)
    rows = []
    for name in variants:
        m = model if name == "fp32" else variant(model, name)
        measures, _ = score(m, windows, bpt, ref_logits)
        measures |= greedy_agreement(greedy_tokens(m, prompts, max_tokens), ref_tokens)
        rows.append(dict(variant=name, **measures))
    return rows
