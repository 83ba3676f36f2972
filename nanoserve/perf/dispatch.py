"""Chapter 06: what launching an operator costs the host, and how many a step launches.

Every PyTorch operator, however small its work, pays a fixed host cost: Python to C++, the dispatcher,
allocating the output, and on a GPU the kernel launch. A step of many small operators is bound by that
cost, not by the arithmetic: its floor is operators x cost per operator. These two measurements give
that floor; a compiled graph or a CUDA graph lowers it by launching fewer, larger pieces.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from nanoserve.device import device as default_device
from nanoserve.perf.timing import timeit


def dispatch_cost(device: str | torch.device | None = None, ops: int = 200, repeat: int = 15) -> float:
    """Seconds the host spends per operator on work too small to matter: a chain of `ops` 1-element adds,
    timed as a whole (median of `repeat`), divided by `ops`. On a GPU this is the launch-bound rate."""
    dev = torch.device(device) if device is not None else default_device()
    x = torch.zeros(1, device=dev)

    def chain():
        y = x
        for _ in range(ops):
            y = y + 1.0
        return y

    return timeit(chain, warmup=3, repeat=repeat, device=dev).median_s / ops


def count_ops(fn: Callable, *args, **kwargs) -> Counter:
    """The operators `fn(*args, **kwargs)` launches from Python, by name: the profiler's aten ops that no
    other aten op called (aten::linear counts once, not again for the aten::addmm inside it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)

    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return Counter(e.name for e in prof.events() if e.name.startswith("aten::") and top_level(e))
