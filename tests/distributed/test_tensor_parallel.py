"""Tensor parallelism (chapter 08): the sharded engine against the single-process one.

Every sharded result is checked against one process on the same weights: greedy tokens per request
under mixed batching (chunked prefills beside decodes, preemption), logits within 1e-4, at tp=2 and at
tp=4 with k/v heads replicated, on the course model and on Qwen2.5-0.5B's shapes. Launches: started by
the LLM itself, under torchrun, under accelerate launch. Failures: bad sizes are ValueErrors before any
process starts, and a worker that dies is named in the error, promptly, with nothing left hanging.
Every process start has a free port and every wait a bound.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

from nanoserve import COURSE_MODEL, LLM, SamplingParams, models
from nanoserve.distributed import ShardPlan, check_tensor_parallel_size
from nanoserve.distributed.group import TensorParallelError
from nanoserve.ports import free_port
from nanoserve.engine.model_runner import StepPlan

from tiny_models import random_prompts, save_tiny_model

LENGTHS, MAX_TOKENS = [5, 30, 7, 61, 12, 1, 45], [10, 3, 25, 8, 1, 17, 12]
ENGINE = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=24, block_size=4)
REPO = Path(__file__).resolve().parents[2]


def greedy(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def last_logits(llm, prompt):
    """Logits of a prompt's last position, one forward through the engine's runner (blocks from 0)."""
    blocks = list(range(-(-len(prompt) // llm.engine.config.block_size)))
    return llm.engine.runner.forward(StepPlan([prompt], [0], [blocks], [0]))[0]


def scored(llm, prompt) -> list[float]:
    """The log-probability of every prompt token after the first and of 4 greedy tokens (the head's rows that
    score the prompt are all-gathered too)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids, entries = out.prompt_token_ids + out.outputs[0].token_ids, out.prompt_logprobs + out.outputs[0].logprobs
    return [e[t].logprob for t, e in zip(ids[1:], entries[1:])]


def check_against_single(directory, tp, engine=ENGINE, lengths=LENGTHS, max_tokens=MAX_TOKENS):
    prompts = random_prompts(lengths, seed=3)
    longest = prompts[lengths.index(max(lengths))]
    single = LLM(str(directory), **engine)
    want, want_logits = greedy(single, prompts, max_tokens), last_logits(single, longest)
    want_scored = scored(single, longest)
    with LLM(str(directory), tensor_parallel_size=tp, **engine) as llm:
        got, got_logits = greedy(llm, prompts, max_tokens), last_logits(llm, longest)
        got_scored = scored(llm, longest)
        m = llm.metrics()
        assert m["tensor_parallel_size"] == tp and m["kv_blocks_free"] == m["kv_blocks_total"]
        assert m["weight_bytes"] < single.metrics()["weight_bytes"] * (1.5 / tp)   # each rank holds about 1/N
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} (prompt of {lengths[i]} tokens): tp={tp} {g} != single {w}"
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    assert len(got_scored) == len(want_scored) and max(abs(g - w) for g, w in zip(got_scored, want_scored)) < 1e-4
    assert not dist.is_initialized()   # shut down: another tensor-parallel LLM may start


# --- the plan: every weight is covered exactly once by the ranks' slices ----------------------------

@pytest.mark.parametrize("heads,kv,world", [(8, 4, 2), (8, 4, 4), (8, 2, 4), (14, 2, 2), (8, 1, 8)])
def test_shards_cover_each_weight(heads, kv, world):
    cfg = models.ModelConfig("LlamaForCausalLM", vocab_size=1001, hidden_size=heads * 4, intermediate_size=8 * world,
                             num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=4)
    d = cfg.head_dim
    plans = [ShardPlan(cfg, r, world) for r in range(world)]
    q = torch.arange(heads * d)
    assert torch.equal(torch.cat([p.shard("model.layers.0.self_attn.q_proj.weight", q) for p in plans]), q)
    down = torch.arange(cfg.intermediate_size)[None]
    assert torch.equal(torch.cat([p.shard("model.layers.0.mlp.down_proj.weight", down) for p in plans], 1), down)
    k = torch.arange(kv * d)
    for p in plans:   # each rank's k/v heads are the ones its query heads read (GQA)
        got = p.shard("model.layers.0.self_attn.k_proj.weight", k).view(-1, d)[:, 0] // d
        want = torch.tensor(sorted({(p.rank * p.heads + h) // (heads // kv) for h in range(p.heads)}))
        assert torch.equal(got, want)
    assert plans[0].replicates_kv == (world > kv)
    vocab = torch.arange(cfg.vocab_size)
    parts = [p.shard("lm_head.weight", vocab) for p in plans]
    assert all(len(x) == plans[0].vocab_rows for x in parts)                  # padded to equal shards
    assert torch.equal(torch.cat(parts)[:cfg.vocab_size], vocab)


@pytest.mark.parametrize("size", [0, -2, 3, 16, True, "2", 2.0])
def test_bad_tensor_parallel_size_is_a_value_error_before_any_process(size):
    start = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=size)
    assert time.monotonic() - start < 5 and not dist.is_initialized()


def test_more_ranks_than_gpus_is_a_value_error():
    cfg = models.ModelConfig.from_path(COURSE_MODEL)
    with pytest.raises(ValueError, match="GPUs"):
        check_tensor_parallel_size(cfg, 8, torch.device("cuda"))   # checked before CUDA is touched


def test_bf16_on_cpu_says_gloo_has_no_bf16_all_reduce():
    with pytest.raises(ValueError, match="gloo"):
        LLM(tensor_parallel_size=2, device="cpu", dtype="bfloat16")
    assert not dist.is_initialized()


# --- equality with one process --------------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
def test_course_model_matches_one_process(tp):
    check_against_single(COURSE_MODEL, tp)


def test_tp4_replicating_kv_heads_matches_one_process(tmp_path):
    # 8 query heads, 2 k/v heads: at tp=4 each k/v head is held by two ranks
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    directory = save_tiny_model(tmp_path, cfg)
    assert ShardPlan(models.ModelConfig.from_path(directory), 0, 4).replicates_kv
    check_against_single(directory, 4)


def test_preemption_under_tp_matches_one_process():
    # a pool too small for all four sequences at once: the scheduler preempts, rank 0's block tables change
    engine = dict(ENGINE, num_kv_blocks=40, max_num_seqs=4)
    check_against_single(COURSE_MODEL, 2, engine, lengths=[40, 38, 45, 30], max_tokens=[40, 40, 40, 40])


def test_real_shape_qwen_layers_match_one_process(tmp_path):
    # Qwen2.5-0.5B's shapes (14 heads, 2 k/v heads, q/k/v biases, a tied 151,936-row vocabulary), 2 of its 24 layers
    cfg = json.loads(models.random_weights.config_file("qwen2.5-0.5b").read_text()) | {"num_hidden_layers": 2}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    directory = models.save_random_model(tmp_path / "cfg", tmp_path / "model")
    check_against_single(directory, 2, dict(ENGINE, max_model_len=128), lengths=[9, 33, 4], max_tokens=[6, 4, 8])


# --- failures -------------------------------------------------------------------------------------

def test_a_dead_worker_is_named_and_nothing_hangs():
    llm = LLM(tensor_parallel_size=2, device="cpu")
    worker = llm.tp.group.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker rank 1"):
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=8), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(TensorParallelError, match="down"):   # the engine stays stopped, and says so
        llm.generate(["again"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert not dist.is_initialized()
    with LLM(tensor_parallel_size=2, device="cpu") as again:   # and a new one starts
        assert again.generate(["Once"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_second_tensor_parallel_llm_in_one_process_is_refused_until_shutdown():
    with LLM(tensor_parallel_size=2, device="cpu"):
        with pytest.raises(RuntimeError, match="shutdown"):
            LLM(tensor_parallel_size=2, device="cpu")


# --- launchers: every rank runs the script; every rank gets rank 0's outputs ------------------------

SCRIPT = """
import json, os, sys
from nanoserve import LLM, SamplingParams
llm = LLM(tensor_parallel_size=2, device="cpu", max_num_seqs=2)
outs = llm.generate(["Once upon a time", "The cat sat on"], SamplingParams(max_tokens=10), use_tqdm=False)
with open(f"rank{os.environ['RANK']}.json", "w") as f:   # a file per rank: their stdout lines interleave
    json.dump([o.outputs[0].token_ids for o in outs], f)
llm.shutdown()
"""


@pytest.fixture(scope="module")
def expected_script_output():
    llm = LLM(device="cpu", max_num_seqs=2)
    outs = llm.generate(["Once upon a time", "The cat sat on"], SamplingParams(max_tokens=10), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_launcher(cmd, tmp_path):
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(cmd + [str(script)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}


def test_torchrun_launch(tmp_path, expected_script_output):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    assert run_launcher(cmd, tmp_path) == {0: expected_script_output, 1: expected_script_output}


def test_accelerate_launch(tmp_path, expected_script_output):
    # on a CPU, accelerate starts N processes through torch's launcher with --multi_gpu (its --cpu path
    # starts one, or N under mpirun); with no CUDA the engine picks gloo
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port())]
    assert run_launcher(cmd, tmp_path) == {0: expected_script_output, 1: expected_script_output}


# --- NCCL --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_nccl_tp2_matches_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    check_against_single(COURSE_MODEL, 2, dict(ENGINE, device="cuda", dtype="float32"))


def test_profile_ranks_reports_every_rank_with_communication():
    from nanoserve.perf.ranks import profile_ranks
    with LLM(tensor_parallel_size=2, device="cpu", max_num_seqs=4) as llm:
        prompts, params = [[5, 6, 7]] * 4, SamplingParams(max_tokens=8, ignore_eos=True)
        reports, outs = profile_ranks(llm, llm.generate, prompts, params, use_tqdm=False)
    assert [r["rank"] for r in reports] == [0, 1] and len(outs) == 4
    for r in reports:
        assert abs(sum(r["breakdown"].values()) - r["wall_s"]) < 1e-6 * max(1.0, r["wall_s"]) + 1e-6
        assert r["comm_s"] > 0 and r["breakdown"]["comm"] > 0   # the all-reduces show up on both ranks
    # the workers' windows are the call's, not rank 0's analysis after it
    assert reports[1]["wall_s"] < 2 * reports[0]["wall_s"] + 0.5


def test_dropping_a_shut_down_llm_leaves_the_next_one_running():
    # the first LLM's finalizer runs when `llm` is rebound: it must not destroy the second's group
    with LLM(tensor_parallel_size=2, device="cpu") as llm:
        pass
    with LLM(tensor_parallel_size=2, device="cpu") as llm:
        import gc
        gc.collect()
        assert llm.generate(["Once"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
