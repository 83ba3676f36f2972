"""Chapter 06 on a GPU: decode steps replayed from CUDA graphs. Replays equal the uncaptured step bit for
bit at every bucket, greedy tokens equal the eager engine's, nothing is captured after start-up."""
from __future__ import annotations

import random

import pytest
import torch

from nanoserve import COURSE_DRAFT_MODEL, COURSE_MODEL, LLM, SamplingParams
from nanoserve.engine.cuda_graphs import CudaGraphDecode
from nanoserve.engine.model_runner import StepPlan



def random_plan(n: int, num_blocks: int, block_size: int, max_blocks: int, seed: int) -> StepPlan:
    """n decodes with random lengths and disjoint block tables (a shuffled pool, as the engine leaves it)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    starts = [rng.randrange(0, max_blocks * block_size) for _ in range(n)]
    tables = [[free.pop() for _ in range(s // block_size + 1)] for s in starts]
    return StepPlan([[rng.randrange(4096)] for _ in range(n)], starts, tables, list(range(n)))


def fill_cache_randomly(cache, device):
    gen = torch.Generator(device).manual_seed(0)
    for t in (cache.k, cache.v):     # keys and values already cached: random
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_graph_step_computes_the_eager_step_on_a_cpu(backend, monkeypatch):
    """Everything but the capture runs on a CPU: step buffers, padding rows, both attention paths."""
    monkeypatch.setenv("NANOSERVE_KERNELS", backend)
    runner = LLM(COURSE_DRAFT_MODEL, device="cpu", max_num_seqs=8, num_kv_blocks=256, max_model_len=256).engine.runner
    assert runner.ops.name == backend and runner.compiled is None
    fill_cache_randomly(runner.kv_cache, "cpu")
    graphs = CudaGraphDecode(runner.model, runner.kv_cache, runner.ops, 8, 256, scratch_block=255, capture=False)
    for n in (1, 3, 8):
        plan = random_plan(n, 255, 16, graphs.width, seed=n)
        assert graphs.accepts(plan)
        padded = graphs.eager(plan)       # first: both write the same keys, so the order does not matter
        torch.testing.assert_close(padded, runner.forward(plan), atol=1e-4, rtol=1e-4)
    too_long = StepPlan([[1]], [256], [list(range(17))], [0])
    assert not graphs.accepts(too_long) and not graphs.accepts(StepPlan([[1, 2]], [0], [[0]], [0]))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def graphed(request):
    llm = LLM(COURSE_MODEL, device="cuda", dtype=request.param, max_num_seqs=32, max_model_len=256,
              num_kv_blocks=1024, block_size=16)
    fill_cache_randomly(llm.engine.runner.kv_cache, "cuda")
    return llm


@pytest.mark.gpu
def test_graphs_are_captured_at_start_one_per_bucket(graphed):
    m = graphed.metrics()
    graphs = graphed.engine.runner.compiled
    assert m["compilation"] == "cudagraph" and m["num_compiles"] == len(graphs.buckets) == 7
    assert m["num_recompiles"] == 0 and m["cudagraph_capture_seconds"] > 0 and m["cudagraph_memory_bytes"] >= 0
    assert graphs.width == 256 // 16


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 3, 8, 13, 24, 32])
def test_replay_equals_the_uncaptured_step_bit_for_bit(graphed, n):
    graphs = graphed.engine.runner.compiled
    plan = random_plan(n, 1024, 16, graphs.width, seed=n)
    assert graphs.accepts(plan)
    replayed = graphs.forward(plan).clone()
    assert torch.equal(replayed, graphs.eager(plan)), f"batch {n}: the replay differs from the same step run eagerly"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 32])
def test_replay_agrees_with_the_eager_engine_step(graphed, n):
    """The unpadded eager step (another batch shape, maybe other matmul kernels): the same logits up to rounding."""
    runner = graphed.engine.runner
    plan = random_plan(n, 1024, 16, runner.compiled.width, seed=100 + n)
    replayed = runner.forward(plan).clone()
    graphs, runner.compiled = runner.compiled, None
    try:
        eager = runner.forward(plan)
    finally:
        runner.compiled = graphs
    if runner.kv_cache.k.dtype == torch.float32:
        torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    else:   # bf16: each kernel rounds its own way; the logits stay within a few percent of their spread
        assert (replayed - eager).abs().max() < 0.05 * (eager.max() - eager.min())


@pytest.mark.gpu
def test_greedy_tokens_equal_the_eager_engine_and_nothing_is_captured_later():
    prompts = [[1 + i, 2, 3] * (1 + 3 * i) for i in range(12)]            # 3..102 tokens
    params = [SamplingParams(temperature=0, max_tokens=20 + 7 * i, ignore_eos=True) for i in range(12)]
    eager = LLM(COURSE_MODEL, device="cuda", max_num_seqs=8, num_kv_blocks=256, enforce_eager=True)
    assert eager.metrics()["compilation"] == "eager"
    graphed = LLM(COURSE_MODEL, device="cuda", max_num_seqs=8, num_kv_blocks=256)   # CUDA's default: graphs
    before = graphed.metrics()
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(got, want))
    assert same == len(want), f"{same}/{len(want)} requests give the eager tokens"
    after = graphed.metrics()
    assert before["compilation"] == "cudagraph" and after["num_compiles"] == before["num_compiles"]
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
