"""Chapter 10: speculative decoding. A cheap proposer guesses k tokens; the target checks them in one forward.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    LLM(speculative_config={"method": "draft_model", "model": COURSE_DRAFT_MODEL, "num_speculative_tokens": 4})

(vLLM's names.) `verify` keeps the output exactly the target's: the same tokens under greedy decoding, the
same distribution when sampling. `proposers` holds prompt lookup and the draft model; `decoder` runs a
speculative step inside the continuous-batching engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.sampling import probs
from nanoserve.speculative.decoder import SpeculativeDecoder
from nanoserve.speculative.proposers import DraftModelProposer, NgramProposer, Proposer
from nanoserve.speculative.verify import verify
from nanoserve.validation import check_int

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None             # draft_model: a Hugging Face-format directory
    prompt_lookup_min: int = 1           # ngram: the shortest suffix to look up
    prompt_lookup_max: int = 4           # ngram: the longest

    @classmethod
    def parse(cls, config) -> "SpeculativeConfig | None":
        """A dict with vLLM's keys (or None: no speculation); a ValueError naming the key otherwise."""
        if config is None:
            return None
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config = {config!r}: expected a dict like "
                             f"{{'method': 'ngram', 'num_speculative_tokens': 4}}")
        unknown = set(config) - {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}")
        method = config.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] = {method!r}: expected one of {METHODS}")
        out = cls(method, config.get("num_speculative_tokens"), config.get("model"),
                  config.get("prompt_lookup_min", 1), config.get("prompt_lookup_max", 4))
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            check_int(f"speculative_config['{key}']", getattr(out, key))
        if out.prompt_lookup_min > out.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({out.prompt_lookup_min}) > prompt_lookup_max "
                             f"({out.prompt_lookup_max})")
        if method == "draft_model" and not isinstance(out.model, str):
            raise ValueError("speculative_config['model']: the draft_model method needs the draft's directory")
        if method == "ngram" and out.model is not None:
            raise ValueError("speculative_config['model']: the ngram method takes no model")
        return out


def build(config: SpeculativeConfig, target, device, dtype, num_kv_blocks: int, block_size: int,
          max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, seed: int) -> SpeculativeDecoder:
    """The decoder for an engine over `target`; a draft model is loaded here, on the target's device."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from nanoserve import models
        draft = models.load(config.model, device=device, dtype=dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"speculative_config['model']: the draft's vocabulary ({draft.config.vocab_size}) is "
                             f"not the target's ({target.config.vocab_size}); they must share a tokenizer")
        # as many positions as the target's pool, plus k per sequence for the drafts past its tokens
        blocks = num_kv_blocks + max_num_seqs * -(-k // block_size) + max_num_seqs
        proposer = DraftModelProposer(draft, k, blocks, block_size, seed)
    return SpeculativeDecoder(proposer, k, max_num_batched_tokens, max_model_len)


__all__ = ["SpeculativeConfig", "SpeculativeDecoder", "Proposer", "NgramProposer", "DraftModelProposer", "probs",
           "verify", "build"]
