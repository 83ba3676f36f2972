"""Load a Hugging Face model directory: config.json + safetensors weights (one file or sharded).

safetensors only: the files are memory-mapped and each tensor goes straight to the target device
and dtype; nothing is unpickled, so a checkpoint cannot run code. Every problem is reported once,
naming the file and the tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from nanoserve.models.config import ModelConfig
from nanoserve.models.decoder import CausalLM
from nanoserve.device import device as resolve_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# tensors some checkpoints carry that the model recomputes (old Llama exports saved rotary tables)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The weights on disk do not fit the model the config describes."""


def resolve_dtype(dtype, dev: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on a GPU and float32 on a CPU (where bf16 matmuls are slow on most chips)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported: expected one of {', '.join(DTYPES)}")
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported: expected 'auto' or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: from the shard index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid shard index ({e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that are not on disk: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        hint = f" (found {', '.join(found)}: pickled weights are not loaded, convert them to safetensors)" if found else ""
        raise CheckpointError(f"no *.safetensors weights in {path}{hint}")
    return files


def load(path, device="auto", dtype="auto") -> CausalLM:
    """Build the model `path/config.json` describes and fill it with `path`'s safetensors weights.

    device: "auto" | "cpu" | "cuda[:N]" | torch.device; dtype: "auto" | "float32" | "bfloat16" | "float16" | torch.dtype.
    Returns the model in eval mode.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with torch.device("meta"):  # no memory, no random init: every tensor comes from the checkpoint
        model = CausalLM(cfg)
    expected = {name: p.shape for name, p in model.named_parameters()}  # tied head appears once
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt", device=str(dev)) as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # tied: the head is the embedding; some exports save it twice
                    if name not in expected:
                        raise CheckpointError(f"{file}: unexpected tensor {name!r}, which a {cfg.architecture} "
                                              f"with this config does not have")
                    shape = f.get_slice(name).get_shape()
                    if tuple(shape) != tuple(expected[name]):
                        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, "
                                              f"the config implies {list(expected[name])}")
                    state[name] = f.get_tensor(name).to(dt)
                    where[name] = file
        except CheckpointError:
            raise
        except Exception as e:  # safetensors reports a bad header or short file as a generic error
            raise CheckpointError(f"cannot read {file}: {e} (is the file truncated or corrupt?)") from None
    missing = [n for n in expected if n not in state]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(repr(n) for n in missing[:3])}{more} "
                              f"(expected shape {list(expected[missing[0]])} for the first)")
    return install_weights(model, state)


def install_weights(model: CausalLM, state: dict[str, torch.Tensor]) -> CausalLM:
    """Put `state` (name -> tensor, a tied head given as the embedding) into a model built on meta; eval mode."""
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True replaced the shared Parameter
    return model.eval()
