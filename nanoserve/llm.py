"""The offline API, after vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref

import torch
from tqdm.auto import tqdm

from nanoserve import models, tokenizer as tokenizer_mod
from nanoserve.engine import EngineArgs, EngineConfig, LLMEngine
from nanoserve.engine.model_runner import profile_activation_peak
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.attention import PagedKVCache
from nanoserve.device import device as resolve_device
from nanoserve.sampling import SamplingParams


class LLM:
    """An offline engine over one model: `LLM(model=None, **engine_args)`.

    model: None (the shipped course model) or a Hugging Face-format directory. Every keyword argument is a
    field of `EngineArgs` (nanoserve/engine/args.py), where each is documented once, with its default; the
    command line and the server take the same options as flags. The ones a chapter introduces:
    max_num_seqs, max_num_batched_tokens, block_size (03), num_kv_blocks, enable_prefix_caching,
    kv_cache_memory, gpu_memory_utilization (04), compilation, enforce_eager (06), quantization (07),
    tensor_parallel_size (08), speculative_config (10).

    With tensor_parallel_size=N in a plain process this LLM is rank 0 and starts ranks 1..N-1 itself; under
    torchrun or accelerate launch every rank builds its LLM with the same arguments and calls generate, and
    every rank gets the outputs. Call `shutdown()` (or use `with LLM(...) as llm:`) to stop the workers before
    building another tensor-parallel LLM. With a speculative_config the output is exactly the target's (greedy:
    the same tokens), and `metrics()` adds spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
    _per_pos; with a quantization, `metrics()["weight_bytes"]` reports what the weights take.
    """

    def __init__(self, model: str | None = None, **engine_args):
        args = self.args = EngineArgs.of(dict(engine_args, model=model)).validate()   # before anything loads
        from nanoserve.models.shipped import COURSE_MODEL
        path = COURSE_MODEL if args.model is None else args.model
        dev = resolve_device(args.device)
        from nanoserve.engine.compiled_decode import resolve_mode
        sharded = args.tensor_parallel_size != 1
        compilation = resolve_mode(args.compilation, args.enforce_eager, dev, sharded=sharded)
        from nanoserve import quant, speculative
        scheme = quant.QuantScheme.parse(args.quantization)
        spec_config = speculative.SpeculativeConfig.parse(args.speculative_config)
        if compilation != "eager" and sharded:
            raise ValueError(f"compilation = {compilation!r} with tensor_parallel_size = {args.tensor_parallel_size}: "
                             f"a sharded engine runs eager for now")
        self.tp = None
        if sharded:   # checked against the model, then the ranks start (or join a launched group)
            from nanoserve.distributed import runtime
            self.tp = runtime.start_ranks(path, args.tensor_parallel_size, dev, args.dtype)
            self.model, dev = self.tp.model, self.tp.device
            weakref.finalize(self, self.tp.shutdown)   # at exit, or when this LLM is dropped, if shutdown() was not called
        else:
            self.model = models.load(path, device=dev, dtype=args.dtype)
            quant.quantize_model(self.model, scheme)
        self.tokenizer = tokenizer_mod.load(path)
        cfg = self.model.config
        if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len = {args.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        wanted_len = args.max_model_len or min(cfg.max_position_embeddings, 2048)
        if self.tp is not None and self.tp.rank > 0:   # a launched worker: rank 0 sizes the pool and schedules
            self.engine = None
            self.tp.serve()
            return
        num_kv_blocks, max_model_len = args.num_kv_blocks, args.max_model_len
        if num_kv_blocks is None:
            if self.tp is not None and args.kv_cache_memory is None:
                self.tp.share_activation_peak(args.max_num_batched_tokens, args.max_num_seqs)
            num_kv_blocks, self.kv_pool_source, self.activation_peak_bytes = kv_pool_size(
                self.model, args.block_size, args.max_num_seqs, wanted_len, args.kv_cache_memory,
                args.gpu_memory_utilization, args.max_num_batched_tokens)
        else:
            self.kv_pool_source, self.activation_peak_bytes = "num_kv_blocks", None
        if max_model_len is None:   # by default a sequence may grow as long as the pool (or the model) allows
            max_model_len = min(wanted_len, num_kv_blocks * args.block_size)
        torch.manual_seed(args.seed)
        self._request_ids = itertools.count()
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, scheduling=args.scheduling,
            compilation=compilation)
        runner = None if self.tp is None else self.tp.runner(num_kv_blocks, args.block_size, args.seed)
        decoder = None if spec_config is None else speculative.build(
            spec_config, self.model, dev, args.dtype, num_kv_blocks, args.block_size, args.max_num_seqs,
            args.max_num_batched_tokens, max_model_len, args.seed)
        self.engine = LLMEngine(self.model, self.tokenizer, config, runner, decoder)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (a no-op for one process)."""
        if self.tp is not None:
            self.tp.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine behind this LLM (also `llm.engine`)."""
        return self.engine

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`, each with
        SamplingParams.n completions (`outputs[i].outputs[j]`, index j).

        prompts: a str, a list of str, or a list of token-id lists. sampling_params: one for all, or one per prompt.
        """
        if self.tp is not None and self.tp.launched:   # every launched rank calls generate; rank 0 runs it
            if self.tp.rank > 0:
                return self.tp.serve()
            try:
                outputs = self._generate(prompts, sampling_params, use_tqdm)
            except BaseException as e:
                self.tp.finish(e)
                raise
            self.tp.finish(outputs)
            return outputs
        return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        # a malformed call (wrong types) fails as a whole, before anything is queued
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(p, (str, list, tuple)):
                raise TypeError(f"prompts[{i}] must be a str or a list of token ids, got {type(p).__name__}")
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        # a bad request (empty, too long, unknown token ids) fails alone: its output carries the error.
        # n samples of a prompt are n requests (ids <id>-0, <id>-1, ...), gathered into one output below
        results: dict[str, RequestOutput | None] = {}
        groups: list[tuple[str, list[str]]] = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            request_id = str(next(self._request_ids))
            samples = [(request_id, sp)] if sp.n == 1 else [(f"{request_id}-{j}", sp.child(j)) for j in range(sp.n)]
            groups.append((request_id, [sample_id for sample_id, _ in samples]))
            for sample_id, sample_params in samples:
                try:
                    self.engine.add_request(sample_id, p, sample_params)
                    results[sample_id] = None
                except ValueError as e:
                    results[sample_id] = self._error_output(sample_id, p, f"prompts[{i}]: {e}")
        bar = tqdm(total=sum(r is None for r in results.values()), desc="generate", disable=not use_tqdm, unit="req")
        while any(r is None or not r.finished for r in results.values()):
            for out in self.engine.step():
                results[out.request_id] = out
                bar.update(out.finished)
        bar.close()
        return [gather_samples(request_id, [results[s] for s in samples]) for request_id, samples in groups]

    @staticmethod
    def _error_output(request_id: str, prompt, message: str) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        ids = [] if isinstance(prompt, str) else list(prompt)
        return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids,
                             outputs=[CompletionOutput(0, "", [], "error")], finished=True, error=message)

    def metrics(self) -> dict:
        """Engine counters: running/waiting requests, KV blocks (total, free), prefix-cache hits,
        preemptions, steps, prefill and decode tokens; how the pool was sized (kv_pool_source, with the
        weights and, on a GPU, the measured activation peak beside kv_cache_bytes)."""
        return self.engine.metrics() | dict(kv_pool_source=self.kv_pool_source, weight_bytes=weight_bytes(self.model),
                                            activation_peak_bytes=self.activation_peak_bytes,
                                            tensor_parallel_size=1 if self.tp is None else self.tp.world_size)


def gather_samples(request_id: str, samples: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput for the n samples of a prompt: their completions in order (index j), the first error."""
    if len(samples) == 1:
        return samples[0]
    first = samples[0]
    outputs = [dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)]
    return dataclasses.replace(first, request_id=request_id, outputs=outputs,
                               error=next((s.error for s in samples if s.error), None))


def kv_pool_size(model, block_size: int, max_num_seqs: int, max_model_len: int, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048
                 ) -> tuple[int, str, int | None]:
    """How many KV blocks to allocate, why, and the activation peak it measured (None off the GPU).

    On a GPU, as a serving engine sizes it (vLLM profiles the same way): run one forward of the largest
    step, `max_num_batched_tokens` tokens, to measure the activations' peak memory; then the pool is what
    is left of `gpu_memory_utilization` x total memory after the weights, that peak and whatever else is on
    the GPU already (the CUDA context, other processes, another engine of this process: the fraction bounds
    what the whole GPU holds, shared or not). CUDA graphs, captured after the pool, take their few MiB
    from the rest. On a CPU, where the KV cache shares RAM with everything else: a stated budget, `kv_cache_memory`
    bytes, by default enough for `max_num_seqs` sequences of `max_model_len` tokens, capped at 1 GiB.
    """
    p = next(model.parameters())
    per_block = PagedKVCache.bytes_per_block(model.config, block_size, p.dtype)
    peak = None                                   # the activations are measured on a GPU only
    if p.device.type == "cuda" and kv_cache_memory is None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization = {gpu_memory_utilization}: expected a fraction in (0, 1]")
        gc.collect()   # an engine dropped but still in a reference cycle frees its pool now, not at the next GC
        peak = profile_activation_peak(model, max_num_batched_tokens, max_num_seqs)   # (empties torch's cache)
        free, total = torch.cuda.mem_get_info(p.device)
        weights = weight_bytes(model)
        # everything already on the GPU but these weights: the CUDA context, other processes, and this
        # process's other tensors (another LLM's pool: a notebook that builds a second engine)
        others = max(0, (total - free) - weights)
        budget = gpu_kv_budget(total, gpu_memory_utilization, weights, peak, others)
        source = (f"{gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB - weights {weights / 2**30:.2f} "
                  f"- activation peak {peak / 2**30:.2f} (a {max_num_batched_tokens}-token step) - "
                  f"{others / 2**30:.2f} GiB in use besides the weights")
    elif kv_cache_memory is None:
        need = max_num_seqs * -(-max_model_len // block_size) * per_block
        budget, source = min(need, 1 << 30), "max_num_seqs x max_model_len, at most 1 GiB"
    else:
        budget, source = int(kv_cache_memory), "kv_cache_memory"
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"KV pool: {budget} bytes ({source}) hold no block of {per_block} bytes")
    return blocks, f"{blocks} blocks x {per_block} B = {blocks * per_block / 2**20:.1f} MiB ({source})", peak


def gpu_kv_budget(total: int, utilization: float, weights: int, activation_peak: int, others: int) -> int:
    """Bytes for the KV pool: utilization x total, minus everything else that must fit beside it."""
    budget = int(total * utilization) - weights - activation_peak - others
    if budget <= 0:
        GiB = 2**30
        raise ValueError(f"gpu_memory_utilization = {utilization} of {total / GiB:.1f} GiB leaves nothing for the KV "
                         f"pool: weights {weights / GiB:.2f} GiB + activation peak {activation_peak / GiB:.2f} GiB + "
                         f"{others / GiB:.2f} GiB in use besides the weights; raise gpu_memory_utilization or lower "
                         f"max_num_batched_tokens")
    return budget


def weight_bytes(model) -> int:
    """Bytes of the model's weights: its parameters and, for a quantized model, the codes and scales its
    layers keep as buffers (a tied embedding and head counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
