"""Per-step host overhead: time from `schedule()` to the forward's first kernel, at decode batch 1 and 64.

What the host does before the device gets work: pick the batch, build positions, cache rows and block
tables, copy them over. On a GPU this time is pure overhead unless it overlaps the previous step; it
is what CUDA graphs and device-side step metadata attack (chapter 06). Measured on steady decode steps
(every sequence past its prefill, 128 prompt tokens), median of the steps, with the total step time beside it.

    python benchmarks/step_overhead.py [--device cpu] [--save benchmarks/results]

It uses only the public engine (LLM, its engine's scheduler and model), so the same script measures an
older checkout too: `PYTHONPATH=<old checkout> python benchmarks/step_overhead.py --label before`.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def measure(batch: int, device: str, steps: int = 30, prompt_len: int = 128) -> dict:
    from nanoserve import LLM, SamplingParams
    llm = LLM(device=device, max_num_seqs=max(batch, 1), max_num_batched_tokens=4096)
    engine = getattr(llm, "llm_engine", None) or llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    marks: dict[str, float] = {}
    schedule = engine.scheduler.schedule

    def timed_schedule():
        marks["schedule"] = time.perf_counter()
        return schedule()

    def first_kernel(module, args):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        marks["forward"] = time.perf_counter()

    engine.scheduler.schedule = timed_schedule
    hook = engine.model.model.embed_tokens.register_forward_pre_hook(first_kernel)
    try:
        add = engine.add_request
        for i, p in enumerate(prompts):
            try:
                add(str(i), p, params)          # the request lifecycle's signature
            except TypeError:
                add(p, params)                  # older engines: (prompt, params)
        engine.step()                           # prefill every prompt (one step: 4096 tokens of budget)
        engine.step()
        host, total = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            total.append(time.perf_counter() - t0)
            host.append(marks["forward"] - marks["schedule"])
    finally:
        hook.remove()
        engine.scheduler.schedule = schedule
    return dict(batch=batch, host_overhead_s=statistics.median(host), step_s=statistics.median(total))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--label", default="current")
    ap.add_argument("--save", type=Path, default=None, help="directory for a JSON record")
    args = ap.parse_args(argv)
    rows = [measure(b, args.device) for b in args.batches]
    for r in rows:
        print(f"{args.label}: decode batch {r['batch']:3d}: host {r['host_overhead_s'] * 1e6:7.0f} us "
              f"of a {r['step_s'] * 1e3:6.2f} ms step ({r['host_overhead_s'] / r['step_s']:.0%})")
    if args.save:
        from nanoserve.course.bench import machine_info, save_record
        save_record(dict(benchmark="step_overhead", label=args.label, device=args.device, model="COURSE_MODEL",
                         machine=machine_info(), rows=rows), args.save, "step_overhead")
    return rows


if __name__ == "__main__":
    main()
