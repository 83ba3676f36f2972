"""Every option of an engine, in one place (vLLM's `EngineArgs`).

`LLM(**kwargs)` builds one, and `python -m nanoserve generate|serve` and the server take their flags from it:
a field here is an `LLM` keyword argument and a `--flag` (its name with dashes, or vLLM's spelling where it
differs), with the same default and the same help. `validate` checks what needs no model; what needs the model
(a length past its positions, a tensor-parallel size its heads do not divide) is checked when it is loaded.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields

from nanoserve.validation import FieldError, check_int, is_number

COMPILATION_MODES = ("eager", "compile", "cudagraph")
SCHEDULING_POLICIES = ("continuous", "static")


def _option(default, help: str, *, flag: str | None = None, cli: bool = True, **argparse_kwargs):
    """A field with its default, its help, and how its flag parses (argparse's type, choices or action)."""
    return field(default=default, metadata={"help": help, "flag": flag, "cli": cli, "argparse": argparse_kwargs})


@dataclass
class EngineArgs:
    model: str | None = _option(None, "a Hugging Face-format directory (default: the shipped course model)")
    device: str = _option("auto", '"auto", "cpu" or "cuda"')
    dtype: object = _option("auto", '"auto", "float32", "bfloat16", "float16" (or a torch.dtype)')
    max_num_seqs: int = _option(32, "sequences decoded together in one step", type=int)
    max_num_batched_tokens: int = _option(2048, "tokens per step, prefill chunks and decodes together", type=int)
    max_model_len: int | None = _option(None, "prompt + output tokens of one sequence (default: the model's, "
                                              "capped at 2048 and at what the KV pool holds)", type=int)
    block_size: int = _option(16, "token positions per KV block", type=int)
    num_kv_blocks: int | None = _option(None, "the KV pool in blocks (default: sized from memory, see "
                                              "kv_pool_size)", flag="--num-gpu-blocks-override", type=int)
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of a prompt prefix already computed",
                                          action=argparse.BooleanOptionalAction)
    kv_cache_memory: int | None = _option(None, "bytes for the KV pool on a CPU (default: enough for max_num_seqs "
                                                "full-length sequences, at most 1 GiB)", type=int)
    gpu_memory_utilization: float = _option(0.9, "the fraction of the GPU's memory this engine may use in all: "
                                                 "weights, the largest step's activations (measured) and the pool",
                                   type=float)
    seed: int = _option(0, "the engine's seed (a request's own SamplingParams.seed overrides it)", type=int)
    scheduling: str = _option("continuous", '"continuous", or "static": the baseline chapter 03 measures against',
                              choices=SCHEDULING_POLICIES)
    tensor_parallel_size: int = _option(1, "shard the model over N ranks (chapter 08); in a plain process this "
                                           "engine is rank 0 and starts the others", cli=False)
    compilation: str | None = _option(None, 'how decode steps run (chapter 06): "eager", "compile" or '
                                            '"cudagraph" (default: cudagraph on CUDA, eager on a CPU and with '
                                            'tensor parallelism)', choices=COMPILATION_MODES)
    enforce_eager: bool = _option(False, 'eager whatever compilation says (vLLM\'s flag)', action="store_true")
    quantization: str | None = _option(None, 'weight-only quantization at load (chapter 07): "int8", "int4" '
                                             '(group 128) or "int4-g32" / -g64 / -g128 / -g256')
    speculative_config: dict | None = _option(None, 'speculative decoding (chapter 10), vLLM\'s dict: {"method": '
                                                    '"ngram", "num_speculative_tokens": 4} or {"method": '
                                                    '"draft_model", "model": DIR, "num_speculative_tokens": 4}',
                                              type=json.loads)

    def validate(self) -> "EngineArgs":
        """Raise a ValueError (a FieldError naming the field, for a bad number) for options that are wrong
        whatever the model. The options with a parser of their own are checked by it when the engine is built
        (compilation against the device, quantization, speculative_config), as is what needs the model."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            check_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            check_int(name, getattr(self, name), none_ok=True)
        check_int("seed", self.seed, minimum=0)
        if not is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise FieldError("gpu_memory_utilization", self.gpu_memory_utilization, "a number in (0, 1]")
        if self.tensor_parallel_size != 1:
            for name, why in (("speculative_config", "speculation runs in one process for now"),
                              ("quantization", "a sharded engine loads full-precision weights for now")):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} = {getattr(self, name)!r} with tensor_parallel_size = "
                                     f"{self.tensor_parallel_size}: {why}")
        return self

    @classmethod
    def of(cls, kwargs: dict, who: str = "LLM()") -> "EngineArgs":
        """EngineArgs from keyword arguments; an unknown one is a TypeError that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{who} got an unknown engine argument {unknown[0]!r}: expected one of "
                            f"{', '.join(sorted(known))}")
        return cls(**kwargs)

    def kwargs(self) -> dict:
        """The fields as LLM keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One `--flag` per field, with its default and help."""
        for f in fields(cls):
            if f.metadata["cli"]:
                parser.add_argument(f.metadata["flag"] or "--" + f.name.replace("_", "-"), dest=f.name,
                                    default=f.default, help=f.metadata["help"], **f.metadata["argparse"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The EngineArgs of parsed flags: every field that has one, the defaults for the rest."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


__all__ = ["EngineArgs", "COMPILATION_MODES", "SCHEDULING_POLICIES"]
