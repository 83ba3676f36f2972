"""Chapter 04: the block manager, paged attention, prefix caching, preemption and chunked prefill."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nanoserve import LLM, SamplingParams
from nanoserve.engine import LLMEngine, Sequence
from nanoserve.engine.block_manager import BlockManager
from nanoserve.kv_cache import KVCache
from nanoserve.models import load
from nanoserve import kernels
from nanoserve.attention import PagedAttention, PagedKVCache, split_by_length

from tiny_models import VOCAB, hf_greedy, random_prompts, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("paged-model"), LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=5))


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def seq_of(n_tokens, seq_id=0):
    return Sequence(seq_id, list(range(10, 10 + n_tokens)), GREEDY)


# --- block accounting ---------------------------------------------------------------------------------
def test_blocks_are_handed_out_on_demand_and_all_or_nothing():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a, b = seq_of(9), seq_of(6, 1)
    assert bm.ensure(a, 9) and len(a.block_table) == 3 and bm.num_free == 2
    assert not bm.ensure(b, 12) and b.block_table == [] and bm.num_free == 2   # needs 3: nothing taken
    assert bm.ensure(b, 6) and bm.num_free == 0
    assert bm.ensure(a, 12)                     # still inside its third block: nothing new
    assert not bm.ensure(a, 13)
    bm.release(a)
    assert bm.num_free == 3 and a.block_table == [] and a.num_cached_tokens == 0
    bm.release(b)
    assert bm.num_free == 5


def test_prefix_blocks_are_shared_and_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq_of(10)
    assert bm.match_prefix(a) == 0
    bm.ensure(a, 10)
    a.num_cached_tokens = 10
    bm.commit_full_blocks(a)                    # two full blocks get hashes; the third is partial
    assert len(a.block_hashes) == 2
    b = Sequence(1, a.token_ids[:9] + [999], GREEDY)   # same first 9 tokens: 2 full blocks match
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    c = Sequence(2, [7] + a.token_ids[1:], GREEDY)     # first token differs: the chain breaks at block 0
    assert bm.match_prefix(c) == 0
    bm.release(b)
    bm.release(a)
    assert bm.num_free == 6
    # freed blocks keep their hashes: a newcomer with the prefix still hits...
    d = Sequence(3, a.token_ids, GREEDY)
    assert bm.match_prefix(d) == 8
    bm.release(d)
    # ...until the pool hands those blocks out again, oldest-freed first
    e = seq_of(24, 4)
    e.token_ids = [5] * 24
    assert bm.ensure(e, 24) and bm.num_free == 0
    f = Sequence(5, a.token_ids, GREEDY)
    assert bm.match_prefix(f) == 0
    assert bm.cached == {}


# --- paged attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_attention_with_scattered_blocks_equals_the_contiguous_cache(model_dir, backend):
    """Blocks in a shuffled order (holes in the pool) give the same attention as chapter 02's cache:
    the torch path with decodes of very different lengths in separate length groups, the C kernel in place."""
    if backend == "cpu" and kernels.backend("auto") != "cpu":
        pytest.skip("no C compiler here: the C kernel is not built")
    model = load(str(model_dir))
    cfg = model.config
    bs = 4
    paged = PagedAttention(PagedKVCache(cfg, num_blocks=120, block_size=bs), cfg, kernels.select(backend))
    flat = KVCache(cfg, num_slots=4, max_len=100)
    ids = list(range(120))
    random.Random(0).shuffle(ids)
    tables = [ids[0:25], ids[25:50], ids[50:75], ids[75:100]]
    prompts = random_prompts([13, 7, 22, 90])
    groups, buffers = [], []
    with torch.inference_mode():
        # prefill (one of them in two chunks), then two decode steps, on both caches
        steps = [([0, 1, 2, 3], [0, 0, 0, 0], [9, 7, 22, 90]), ([0], [9], [4]),
                 ([0, 1, 2, 3], [13, 7, 22, 90], [1, 1, 1, 1]), ([0, 1, 2, 3], [14, 8, 23, 91], [1, 1, 1, 1])]
        seqs = [p + [11, 12] for p in prompts]
        for rows, starts, lengths in steps:
            tokens = [t for r, s, n in zip(rows, starts, lengths) for t in seqs[r][s:s + n]]
            positions = [p for s, n in zip(starts, lengths) for p in range(s, s + n)]
            ids_t, pos_t = torch.tensor([tokens]), torch.tensor([positions])
            paged.prepare([tables[r] for r in rows], starts, lengths)
            flat.prepare(rows, starts, lengths)
            assert paged.metadata.positions.tolist() == positions
            got = model.hidden_states(ids_t, pos_t, paged)
            groups.append(len(paged.metadata.scratch.get("decode_groups", [])))
            want = model.hidden_states(ids_t, pos_t, flat)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            buffers.append({k: b.data_ptr() for k, b in (paged._workspace or {}).items()})
    if backend == "torch":   # the gathers of the two decode steps reuse one buffer each for keys and values
        assert buffers[2] and buffers[3] == buffers[2]
    # the 91-token sequence is not padded onto the short ones (torch); the C kernel needs no groups
    assert groups == ([0, 0, 2, 2] if backend == "torch" else [0, 0, 0, 0])


def test_step_metadata_rows_and_tables_from_tensor_ops():
    """Cache rows, positions and padded block tables of a mixed step, against the arithmetic by hand."""
    from nanoserve.attention import StepInputs
    ids, meta = StepInputs(block_size=4).build([[7, 8, 9], [5], [1, 2]], [0, 6, 9], [[3], [9, 2], [0, 5, 4]])
    assert ids.tolist() == [[7, 8, 9, 5, 1, 2]]
    assert meta.positions.tolist() == [0, 1, 2, 6, 9, 10]
    assert meta.slot_mapping.tolist() == [12, 13, 14, 2 * 4 + 2, 4 * 4 + 1, 4 * 4 + 2]
    assert meta.block_tables.tolist() == [[3, -1, -1], [9, 2, -1], [0, 5, 4]]
    assert meta.context_lens.tolist() == [3, 7, 11]
    assert meta.decode_tokens.tolist() == [3] and meta.decode_tables.tolist() == [[9, 2]]
    assert meta.decode_context.tolist() == [7] and not meta.all_decodes
    assert meta.prefills == [(0, 0, 3, 0), (2, 4, 2, 9)] and meta.last_tokens == [2, 3, 5]


def test_a_padded_decode_step_is_the_same_step_with_padding_rows_in_the_scratch_block():
    """One builder: with a Padding target the real rows are the unpadded step's, the rest point at the scratch block."""
    from nanoserve.attention import Padding, StepInputs
    inputs = StepInputs(block_size=4)
    plan = ([[5], [6], [7]], [6, 0, 9], [[9, 2], [3], [0, 5, 4]])
    _, plain = inputs.build(*plan)
    a = inputs.arrays(*plan, pad=Padding(batch=4, width=4, scratch_block=30))
    assert a["ids"].tolist() == [5, 6, 7, 0]
    assert a["positions"].tolist() == plain.positions.tolist() + [0]
    assert a["slots"].tolist() == plain.slot_mapping.tolist() + [30 * 4]
    assert a["context"].tolist() == [7, 1, 10, 1]
    assert a["tables"].tolist() == [[9, 2, 30, 30], [3, 30, 30, 30], [0, 5, 4, 30], [30] * 4]
    with pytest.raises(ValueError, match="decodes only"):
        inputs.arrays([[5, 6]], [0], [[1]], pad=Padding(1, 1, 30))


def test_attention_runs_one_step_at_a_time():
    from nanoserve.attention import StepInputs
    llm = LLM(device="cpu", num_kv_blocks=8, max_num_seqs=1)
    attention = llm.engine.runner.attention
    _, meta = StepInputs(16).build([[1]], [0], [[0]])
    with attention.step(meta):
        assert attention.metadata is meta
        with pytest.raises(RuntimeError, match="already running a step"):
            with attention.step(meta):
                pass
    assert attention.metadata is None            # left with the step: a later forward cannot read a stale one


def test_split_by_length_cuts_where_padding_costs_more_than_a_call():
    assert split_by_length([]) == []
    assert split_by_length([5] * 10) == [(0, 10)]
    assert split_by_length([1, 2, 3, 4]) == [(0, 4)]                  # saving under the 16-block call cost
    assert split_by_length([1, 1, 2, 3, 10, 11, 12, 30, 31]) == [(0, 4), (4, 7), (7, 9)]
    assert len(split_by_length(list(range(1, 200)), max_groups=4)) == 4


def test_a_block_table_too_short_for_the_step_is_refused(model_dir):
    cfg = load(str(model_dir)).config
    attention = PagedAttention(PagedKVCache(cfg, num_blocks=4, block_size=4), cfg)
    with pytest.raises(ValueError, match="covers 4 positions; the step needs 6"):
        attention.prepare([[2]], [0], [6])


# --- the engine ---------------------------------------------------------------------------------------
def test_prefix_caching_skips_the_shared_prefill_and_keeps_outputs(model_dir, reference):
    system = random_prompts([50], seed=1)[0]
    questions = random_prompts([5, 9, 3], seed=2)
    prompts = [system + q for q in questions]
    llm = LLM(str(model_dir), block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    m = llm.metrics()
    assert m["prefix_cache_hit_tokens"] == 2 * 48          # 3 full blocks of the 50-token system prompt, twice
    assert m["prefix_cache_queried_tokens"] == sum(map(len, prompts))
    assert m["prefill_tokens"] == sum(map(len, prompts)) - 96
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    for p, o in zip(prompts, first + rest):
        assert o.outputs[0].token_ids == hf_greedy(reference, p, GREEDY.max_tokens)
    off = LLM(str(model_dir), block_size=16, enable_prefix_caching=False)
    off.generate(prompts, GREEDY, use_tqdm=False)
    assert off.metrics()["prefix_cache_hit_tokens"] == 0 and off.metrics()["prefill_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_small_pool_keeps_every_output(model_dir, reference, prefix_caching):
    lengths, max_tokens = [20, 35, 12, 28, 40, 9], [30, 12, 40, 25, 18, 33]
    prompts = random_prompts(lengths, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    params[1] = SamplingParams(temperature=0.8, top_k=50, max_tokens=12, ignore_eos=True, seed=7)  # seeded
    roomy = LLM(str(model_dir), block_size=8, max_num_seqs=6)
    tight = LLM(str(model_dir), block_size=8, max_num_seqs=6, num_kv_blocks=12, max_model_len=96,
                enable_prefix_caching=prefix_caching)
    want = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    m = tight.metrics()
    assert m["num_preemptions"] > 0 and roomy.metrics()["num_preemptions"] == 0
    assert sum(o.metrics["num_preemptions"] for o in got) == m["num_preemptions"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for i in (0, 2, 5):
        assert got[i].outputs[0].token_ids == hf_greedy(reference, prompts[i], max_tokens[i])
    assert m["kv_blocks_free"] == m["kv_blocks_total"] == 12 and m["num_running"] == m["num_waiting"] == 0
    # every prompt token and every fed-back output token counted once; the rest is recomputation
    assert m["prefill_tokens"] == sum(lengths) and m["decode_tokens"] == sum(len(o.outputs[0].token_ids) - 1 for o in got)
    assert m["recomputed_tokens"] > 0 and roomy.metrics()["recomputed_tokens"] == 0


def test_chunked_prefill_lets_decodes_flow(model_dir, reference):
    """A long prompt arriving mid-run is prefilled in budget-sized chunks while the others keep decoding."""
    llm = LLM(str(model_dir), max_num_batched_tokens=32, max_num_seqs=4)
    engine: LLMEngine = llm.engine
    short = random_prompts([6, 10], seed=4)
    long = random_prompts([150], seed=5)[0]
    seqs = [engine.add_request(f"short-{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for i, p in enumerate(short)]
    engine.step()                                # both short prompts prefilled
    big = engine.add_request("long", long, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    chunks = []
    while big.num_cached_tokens < len(long):
        batch = engine.scheduler.schedule()
        assert [n for s, n in batch if s is not big] == [1, 1]     # every step still decodes both
        chunks.append(dict(batch)[big])
        engine.scheduler.update(batch, engine.runner.run(batch), 0.0)
    assert chunks == [30] * 5                    # 32-token budget minus the two decodes
    while engine.has_unfinished():
        engine.step()
    for s, p, n in [(seqs[0], short[0], 20), (seqs[1], short[1], 20), (big, long, 4)]:
        assert s.output_token_ids == hf_greedy(reference, p, n)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_pool_sizing_and_its_errors(model_dir):
    llm = LLM(str(model_dir), max_num_seqs=4, block_size=16)
    m = llm.metrics()
    assert m["kv_blocks_total"] == 4 * 512 // 16 and "max_num_seqs x max_model_len" in m["kv_pool_source"]
    assert m["kv_cache_bytes"] == m["kv_blocks_total"] * PagedKVCache.bytes_per_block(llm.model.config, 16)
    budget = LLM(str(model_dir), block_size=16, kv_cache_memory=20 * m["kv_cache_bytes"] // m["kv_blocks_total"])
    assert budget.metrics()["kv_blocks_total"] == 20
    assert budget.engine.config.max_model_len == 320         # a sequence can grow only as far as the pool
    with pytest.raises(ValueError, match=r"the KV pool \(4 blocks of 16 = 64 tokens\) cannot hold one sequence "
                                         r"of max_model_len = 128"):
        LLM(str(model_dir), num_kv_blocks=4, max_model_len=128)
    with pytest.raises(ValueError, match="hold no block"):
        LLM(str(model_dir), kv_cache_memory=100)
    small = LLM(str(model_dir), num_kv_blocks=4, block_size=16)   # 64 tokens: a longer prompt fails alone
    outs = small.generate([[7] * 80, [8] * 10], GREEDY, use_tqdm=False)
    assert outs[0].error == "prompts[0]: prompt has 80 tokens; max_model_len is 64 (prompt plus at least one new token)"
    assert len(outs[1].outputs[0].token_ids) == 8


def test_gpu_pool_arithmetic_leaves_room_for_weights_activations_and_others():
    from nanoserve.llm import gpu_kv_budget
    GiB = 2**30
    # an 80 GiB GPU at 0.9: 72 GiB for this engine; 16 of weights, 3 of activations, 1 held outside torch
    assert gpu_kv_budget(80 * GiB, 0.9, 16 * GiB, 3 * GiB, 1 * GiB) == 52 * GiB
    # 12 GiB of a 24 GiB GPU cannot hold 16 GiB of weights: refused, with the numbers and the knobs
    with pytest.raises(ValueError, match=r"gpu_memory_utilization = 0.5 of 24.0 GiB leaves nothing for the KV pool: "
                                         r"weights 16.00 GiB \+ activation peak 1.00 GiB.*max_num_batched_tokens"):
        gpu_kv_budget(24 * GiB, 0.5, 16 * GiB, 1 * GiB, 0)


def test_weight_bytes_count_a_tied_head_once():
    llm = LLM(max_num_seqs=2)                 # the course model ties its head to the embedding
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    assert llm.metrics()["weight_bytes"] == 4 * 5_401_856       # fp32, its 5.4M parameters, the shared matrix once
    assert llm.metrics()["activation_peak_bytes"] is None        # measured on a GPU only


@pytest.mark.gpu
def test_gpu_pool_is_sized_after_a_profiling_forward(model_dir):
    import torch
    llm = LLM(str(model_dir), device="cuda", max_num_batched_tokens=512, gpu_memory_utilization=0.5)
    m = llm.metrics()
    assert "activation peak" in m["kv_pool_source"] and m["kv_blocks_total"] > 0 and m["activation_peak_bytes"] > 0
    total = torch.cuda.mem_get_info()[1]
    assert m["kv_cache_bytes"] + m["weight_bytes"] + m["activation_peak_bytes"] <= 0.5 * total
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="leaves nothing for the KV pool"):
        LLM(str(model_dir), device="cuda", gpu_memory_utilization=1e-6)


def test_aborted_requests_give_their_blocks_back(model_dir):
    engine = LLM(str(model_dir), block_size=4).engine
    seqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(random_prompts([9, 17, 5]))]
    engine.step()
    engine.step()
    assert engine.block_manager.num_free < engine.block_manager.num_blocks
    engine.abort(["0", "1"])
    while engine.has_unfinished():
        engine.step()
    assert seqs[2].finish_reason == "length" and [s.finish_reason for s in seqs[:2]] == ["abort", "abort"]
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


@pytest.mark.gpu
def test_step_metadata_on_cuda_equals_the_cpu_build():
    """Pinned staging and non-blocking copies give the same numbers; steps in a row reuse the buffers safely."""
    from nanoserve.attention import StepInputs
    cpu, gpu = StepInputs(4), StepInputs(4, "cuda")
    for step in range(3):
        args = ([[7, 8, 9][:step + 1], [5], [1, 2]], [0, 5 + step, 9], [[3], [9, 2], [0, 5, 4]])
        (a_ids, a), (b_ids, b) = cpu.build(*args), gpu.build(*args)
        assert b.slot_mapping.is_cuda and torch.equal(b_ids.cpu(), a_ids)
        for name in ("positions", "slot_mapping", "block_tables", "context_lens", "decode_tokens", "decode_tables"):
            assert torch.equal(getattr(b, name).cpu(), getattr(a, name)), name


def test_every_attention_path_is_an_attention_backend():
    # the model's one seam: each chapter's way of holding keys implements attend(layer, q, k, v)
    from nanoserve.attention import AttentionBackend
    from nanoserve.engine.compiled_decode import StaticDecodeAttention
    from nanoserve.engine.cuda_graphs import InPlaceDecodeAttention
    from nanoserve.models import ModelConfig
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    cache = PagedKVCache(cfg, 4, 16)
    for backend in (KVCache(cfg, 1, 8), PagedAttention(cache, cfg),
                    StaticDecodeAttention(None, None, 4, 16, None, None, None, None),
                    InPlaceDecodeAttention(cache, None, cfg, None, None, None)):
        assert isinstance(backend, AttentionBackend), type(backend).__name__
    assert not isinstance(cache, AttentionBackend)   # the pool holds tensors; PagedAttention attends over it
