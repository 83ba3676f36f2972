"""The engine against transformers, request by request, under mixed batching, for every family.

Prompts of very different lengths share steps (chunked prefills beside decodes, a tight token budget),
through the paged KV cache, with each kernel backend this machine can run: every request's greedy
tokens must be what transformers generates for it alone. The Mistral config has a sliding window
shorter than the prompts, so the window is exercised through the block tables, not only in chapter 02.
"""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from nanoserve import COURSE_MODEL, LLM, SamplingParams, kernels

from tiny_models import VOCAB, hf_greedy, random_prompts

FAMILIES = {
    "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256),
    "mistral-window": MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1, sliding_window=7,
                                    max_position_embeddings=256),
    "qwen2": Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256),
    "qwen3": Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
}
CPU_BACKENDS = ["torch"] + (["cpu"] if kernels.backend("auto") == "cpu" else [])
LENGTHS, MAX_TOKENS = [5, 30, 7, 61, 12, 1, 45], [10, 3, 25, 8, 1, 17, 12]


def save(hf_cfg, directory, dtype=torch.float32):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    ref.save_pretrained(directory)
    shutil.copy(f"{COURSE_MODEL}/tokenizer.json", directory)
    return ref


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save(FAMILIES[request.param], directory)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_batch_greedy_equals_transformers_per_request(family, backend, monkeypatch):
    name, directory, ref = family
    monkeypatch.setenv("NANOSERVE_KERNELS", backend)
    prompts = random_prompts(LENGTHS, seed=3)
    llm = LLM(str(directory), device="cpu", max_num_seqs=4, max_num_batched_tokens=24, block_size=4)
    assert llm.engine.runner.ops.name == backend
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS],
                        use_tqdm=False)
    for p, m, o in zip(prompts, MAX_TOKENS, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, m), f"{name}, prompt of {len(p)} tokens"
    m = llm.metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_greedy_on_cuda_agrees_with_transformers(name, tmp_path):
    """bf16 rounds differently in different kernels: near-ties may flip, so most tokens, not all, agree."""
    ref = save(FAMILIES[name], tmp_path, torch.bfloat16).cuda()
    prompts = random_prompts(LENGTHS, seed=4)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    same = total = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        got = o.outputs[0].token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        same, total = same + first_diff, total + len(want)    # tokens before the first disagreement
    assert same >= 0.8 * total, f"{name}: {same}/{total} tokens agree before the first difference"
