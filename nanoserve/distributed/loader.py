"""Chapter 08: load one rank's shard from the same safetensors checkpoint a single process loads.

Each rank reads only its slices (safetensors slices on the memory-mapped file), so a model that
does not fit one device never has to be whole on any of them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from nanoserve.distributed.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from nanoserve.distributed.sharding import ShardPlan
from nanoserve.models.decoder import CausalLM
from nanoserve.models.loader import _IGNORED_SUFFIXES, CheckpointError, install_weights, weight_files


def sharded_model(plan: ShardPlan, group=None) -> CausalLM:
    """The shard's modules on the meta device: a CausalLM on fewer heads with the talking layers swapped in."""
    cfg, local = plan.cfg, plan.local_config()
    with torch.device("meta"):
        model = CausalLM(local)
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(local.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                                       cfg.o_bias, group)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, cfg.mlp_bias, group)
        model.model.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, cfg.hidden_size, plan.vocab_start, group)
        model.lm_head = VocabParallelHead(plan.vocab_rows, cfg.hidden_size, cfg.vocab_size, plan.world_size, group)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.shard_plan = plan   # model.config stays the shard's: its KV cache holds this rank's k/v heads only
    return model


def load_shard(path, plan: ShardPlan, device: torch.device, dtype: torch.dtype, group=None) -> CausalLM:
    """Rank `plan.rank`'s shard of the checkpoint in `path`, in eval mode."""
    path = Path(path)
    cfg = plan.cfg
    with torch.device("meta"):
        full = {n: list(p.shape) for n, p in CausalLM(cfg).named_parameters()}   # the checkpoint's shapes
    model = sharded_model(plan, group)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    if name not in full:
                        raise CheckpointError(f"{file}: unexpected tensor {name!r}")
                    sl = f.get_slice(name)
                    if list(sl.get_shape()) != full[name]:
                        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(sl.get_shape())}, "
                                              f"the config implies {full[name]}")
                    where = plan.slice_of(name, full[name])
                    if where is None:
                        t = sl[:]
                    elif where[0] == 0:
                        t = sl[where[1]]
                    else:
                        t = sl[:, where[1]]
                    state[name] = plan.pad_vocab(name, t).to(device=device, dtype=dtype)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read {file}: {e} (is the file truncated or corrupt?)") from None
    missing = [n for n in full if n not in state]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(map(repr, missing[:3]))}")
    return install_weights(model, state)
