"""Time the engine's decode steps at a fixed batch: what one token costs each running sequence.

    timer = perf.DecodeTimer(model, batch_size=1)     # an engine over `model`, prefilled, decoding
    timer.step_seconds(8)                             # 8 decode steps, one time each (synced)

Several timers can run side by side, one per variant of a model, and be timed in turns (round robin)
so that a noisy neighbour slows every variant alike: the ratios hold when the absolute times do not.
"""
from __future__ import annotations

import time

import torch

from nanoserve.device import sync


class DecodeTimer:
    """`batch_size` sequences of `prompt_len` tokens prefilled in the engine, then decoded on demand.

    The sequences never finish (ignore_eos, a length budget of `max_steps`), so every timed step is a
    decode of the full batch at a context that grows by one token a step.
    """

    def __init__(self, model, batch_size: int = 1, prompt_len: int = 16, max_steps: int = 256,
                 compilation: str = "eager"):
        from nanoserve.engine import EngineConfig, LLMEngine
        from nanoserve.sampling import SamplingParams
        if batch_size < 1 or prompt_len < 1 or max_steps < 1:
            raise ValueError(f"DecodeTimer needs batch_size, prompt_len and max_steps >= 1, got "
                             f"{batch_size}, {prompt_len}, {max_steps}")
        self.device = next(model.parameters()).device
        self.batch_size, self.max_steps = batch_size, max_steps
        max_len = prompt_len + max_steps + 2
        blocks = batch_size * -(-max_len // 16)
        self.engine = LLMEngine(model, None, EngineConfig(
            max_num_seqs=batch_size, max_model_len=max_len, num_kv_blocks=blocks, compilation=compilation,
            max_num_batched_tokens=max(2048, batch_size * prompt_len), enable_prefix_caching=False))
        params = SamplingParams(temperature=0.0, max_tokens=max_steps + 1, ignore_eos=True)
        vocab = model.config.vocab_size
        for i in range(batch_size):   # distinct prompts: no sharing, no prefix hits
            self.engine.add_request(f"decode-{i}", [(7 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)], params)
        self.engine.step()   # the prefill, untimed
        self.steps_done = 0

    def step_seconds(self, n: int) -> list[float]:
        """Run `n` decode steps; the wall time of each, the device synced before and after."""
        if self.steps_done + n > self.max_steps:
            raise ValueError(f"DecodeTimer: {self.steps_done} of max_steps={self.max_steps} steps used, "
                             f"{n} more asked for; build it with a larger max_steps")
        times = []
        for _ in range(n):
            sync(self.device)
            t0 = time.perf_counter()
            self.engine.step()
            sync(self.device)
            times.append(time.perf_counter() - t0)
        self.steps_done += n
        return times


def interleaved_decode(timers: dict[str, DecodeTimer], rounds: int = 5, steps: int = 4) -> dict[str, float]:
    """Median decode-step seconds of each timer, timed in `rounds` turns of `steps` steps (after one
    untimed step each, which warms caches and lazy initialisation)."""
    for t in timers.values():
        t.step_seconds(1)
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, t in timers.items():
            samples[name] += t.step_seconds(steps)
    return {name: float(torch.tensor(s).median()) for name, s in samples.items()}
