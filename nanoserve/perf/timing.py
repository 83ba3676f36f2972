"""Timing device work honestly: warm up, synchronise, repeat, report the median and the spread.

On a CPU each run is bracketed by `time.perf_counter()` (with `sync()` around it, a no-op there).
On a GPU, kernel launches return before the work is done, so each run is bracketed by CUDA events
recorded on the stream and read after a synchronise.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from nanoserve.device import device as _device, sync


def format_seconds(s: float) -> str:
    """A duration in seconds as a short human string: '812 ns', '4.56 us', '1.23 ms', '2.50 s'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}" if s / scale < 100 else f"{s / scale:.0f} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (0 <= q <= 1) of an already sorted list."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Repeated wall-clock measurements of one function, in seconds."""

    samples_s: tuple[float, ...]  # one entry per timed run, in run order
    device: str                   # where the work ran, e.g. "cpu" or "cuda:0"

    @property
    def n(self) -> int:
        return len(self.samples_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    @property
    def p10_s(self) -> float:
        return _quantile(sorted(self.samples_s), 0.10)

    @property
    def p90_s(self) -> float:
        return _quantile(sorted(self.samples_s), 0.90)

    def __str__(self) -> str:
        if self.n == 1:
            return f"{format_seconds(self.median_s)} (a single run)"
        return (f"{format_seconds(self.median_s)} median "
                f"(p10 {format_seconds(self.p10_s)}, p90 {format_seconds(self.p90_s)}, n={self.n})")


def timeit(fn: Callable, *args, warmup: int = 3, repeat: int = 20,
           device: str | torch.device | None = None, **kwargs) -> Timing:
    """Run `fn(*args, **kwargs)` `warmup` times untimed, then `repeat` times timed.

    Each timed run is measured alone, so the result carries the spread as well as the median.
    `device` says where `fn` does its work (default: `perf.device()`); on CUDA the runs are timed
    with CUDA events, elsewhere with `time.perf_counter()` after a `sync()`.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"timeit needs repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    dev = _device(device)
    for _ in range(warmup):
        fn(*args, **kwargs)
    samples = []
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                sync(dev)
                start.record()
                fn(*args, **kwargs)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    else:
        for _ in range(repeat):
            sync(dev)
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            sync(dev)
            samples.append(time.perf_counter() - t0)
    return Timing(samples_s=tuple(samples), device=str(dev))
