"""Chapter 06: compiled decode. Buckets, padding into a scratch block, compiled == eager, no recompiles."""
from __future__ import annotations

import pytest
import torch

from nanoserve import COURSE_DRAFT_MODEL, LLM, SamplingParams
from nanoserve.attention import StepInputs
from nanoserve.engine.compiled_decode import batch_buckets, resolve_mode, width_bucket
from nanoserve.engine.model_runner import StepPlan


@pytest.mark.parametrize("max_num_seqs, buckets", [
    (1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (10, [1, 2, 4, 8, 16]), (32, [1, 2, 4, 8, 16, 24, 32]),
    (33, [1, 2, 4, 8, 16, 24, 32, 40])])
def test_batch_buckets_cover_every_batch_up_to_max_num_seqs(max_num_seqs, buckets):
    assert batch_buckets(max_num_seqs) == buckets


def test_width_bucket_is_the_next_power_of_two():
    assert [width_bucket(b) for b in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]


def test_modes_are_checked_against_the_device():
    cpu = torch.device("cpu")
    assert resolve_mode(None, False, cpu) == "eager"
    assert resolve_mode("compile", True, cpu) == "eager"      # vLLM's enforce_eager wins
    with pytest.raises(ValueError, match="'fast'.*expected one of"):
        resolve_mode("fast", False, cpu)
    with pytest.raises(ValueError, match="needs a CUDA device.*'cpu'"):
        resolve_mode("cudagraph", False, cpu)
    cuda = torch.device("cuda")     # the rule alone: no CUDA device is needed to check it
    assert resolve_mode(None, False, cuda) == "cudagraph"            # CUDA's default: graphs
    assert resolve_mode(None, False, cuda, sharded=True) == "eager"  # tensor parallelism runs eager
    assert resolve_mode("cudagraph", True, cuda) == "eager"
    with pytest.raises(ValueError, match="compilation"):
        LLM(model=COURSE_DRAFT_MODEL, device="cpu", compilation="graphs")


def test_compile_with_tensor_parallel_is_refused_before_any_process():
    with pytest.raises(ValueError, match="tensor_parallel_size = 2"):
        LLM(device="cpu", tensor_parallel_size=2, compilation="compile")


def test_padding_rows_write_and_read_only_the_scratch_block():
    llm = LLM(model=COURSE_DRAFT_MODEL, device="cpu", compilation="compile", num_kv_blocks=64, max_num_seqs=8)
    compiled = llm.engine.runner.compiled
    plan = StepPlan([[5], [6], [7]], [20, 3, 40], [[4, 9], [2], [7, 8, 11]], [0, 1, 2])
    (B, W), (ids, positions, slots, tables, context) = compiled.pad(plan)
    assert (B, W) == (4, 4) and compiled.scratch_block == 64
    assert llm.engine.runner.kv_cache.num_blocks == 65          # the pool plus the scratch block
    _, meta = StepInputs(16).build(plan.token_ids, plan.starts, plan.block_tables)
    assert slots[:3].tolist() == meta.slot_mapping.tolist()      # real rows write where the eager step writes
    assert positions[:3].tolist() == meta.positions.tolist()
    assert context[:3].tolist() == [21, 4, 41] and context[3] == 1
    assert tables[3].tolist() == [64] * 4 and slots[3] == 64 * 16   # the padding row: the scratch block only
    assert tables[0].tolist() == [4, 9, 64, 64]                  # past its blocks: scratch, masked by its length


@pytest.fixture(scope="module")
def draft_runs():
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9] * 20]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 12, 18)]
    eager = LLM(model=COURSE_DRAFT_MODEL, device="cpu", max_num_seqs=4)
    compiled = LLM(model=COURSE_DRAFT_MODEL, device="cpu", max_num_seqs=4, compilation="compile")
    first = compiled.generate(prompts, params, use_tqdm=False)
    after_first = dict(compiled.metrics())
    second = compiled.generate(prompts, params, use_tqdm=False)
    return dict(eager=eager.generate(prompts, params, use_tqdm=False), first=first, second=second,
                after_first=after_first, after_second=compiled.metrics())


def test_compiled_decode_gives_the_eager_greedy_tokens(draft_runs):
    want = [o.outputs[0].token_ids for o in draft_runs["eager"]]
    assert [o.outputs[0].token_ids for o in draft_runs["first"]] == want
    assert [o.outputs[0].token_ids for o in draft_runs["second"]] == want


def test_steady_decoding_compiles_nothing_more(draft_runs):
    first, second = draft_runs["after_first"], draft_runs["after_second"]
    assert first["compilation"] == "compile"
    # batches of 3, 2 and 1 sequences (buckets 4, 2, 1), contexts within 2 blocks (widths 1 and 2)
    assert 3 <= first["num_compiles"] <= 6, first
    assert second["num_compiles"] == first["num_compiles"], "the same steps again must reuse their graphs"
    assert first["compile_seconds"] > 0 and second["compile_seconds"] == first["compile_seconds"]
    assert second["num_recompiles"] == 0


def test_compiled_logits_match_eager_within_float_tolerance():
    eager = LLM(model=COURSE_DRAFT_MODEL, device="cpu", max_num_seqs=2, num_kv_blocks=16)
    compiled = LLM(model=COURSE_DRAFT_MODEL, device="cpu", max_num_seqs=2, num_kv_blocks=16, compilation="compile")
    plan_prefill = StepPlan([[3, 4, 5], [6, 7]], [0, 0], [[0], [1]], [0, 1])
    plan_decode = StepPlan([[8], [9]], [3, 2], [[0], [1]], [0, 1])
    out = []
    for llm in (eager, compiled):
        runner = llm.engine.runner
        runner.forward(plan_prefill)
        out.append(runner.forward(plan_decode))
    assert compiled.metrics()["num_compiles"] == 1
    torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)


def test_a_decode_as_the_first_step_compiles_once():
    """The rotary table is made when the runner is built: a first step traced before any prefill does not
    see it missing (that traced the first-use branch, and the bucket recompiled on its next step)."""
    runner = LLM(model=COURSE_DRAFT_MODEL, device="cpu", compilation="compile", num_kv_blocks=16,
                 max_num_seqs=1).engine.runner
    for start in (3, 4, 5):
        runner.forward(StepPlan([[7]], [start], [[2]], [0]))
    assert runner.compiled.num_compiles == 1 and runner.compiled.num_recompiles == 0


def test_the_command_line_takes_the_compilation_mode(capsys):
    from nanoserve.__main__ import main
    main(["generate", "def f(", "--device", "cpu", "--max-tokens", "3", "--enforce-eager", "--compilation", "compile"])
    assert "3 tokens, finish_reason=length" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["generate", "def f(", "--device", "cpu", "--compilation", "cudagraph"])
