"""Profile a function and say where its time went: is the accelerator busy, and if not, why not?

    prof = perf.profile(job, corpus)            # runs job(corpus) under torch.profiler
    prof.busy_fraction                          # accelerator busy time / wall time
    prof.breakdown()                            # seconds per category, summing to the wall time
    with perf.region("data"): batch = load()    # label host work so the breakdown can name it

On a GPU the accelerator is the CUDA streams. On a CPU machine the thread that called `profile` plays
the accelerator: its torch operators are "device" work, except inside a `perf.region`, whose time is
host work of that label (tokenizing with torch ops is still tokenizing). Collectives run by gloo on its
own threads play the communication stream.

`breakdown()` gives every instant of the wall time to one category:
  device busy          -> "compute", else "comm", else "memcpy" (the busiest kind wins where they overlap);
  device idle, in a region -> the innermost region's label ("data", "tokenize", "h2d", ...);
  device idle, host running torch ops outside any region -> "host" (launch and dispatch work on a GPU);
  anything else        -> "idle" (Python between operators, waits nothing labelled).
A DataLoader's `__next__` counts as "data" even unlabelled.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from nanoserve.device import device as _device, sync
from nanoserve.perf.trace import REGION_PREFIX, WINDOW_NAME, Event, events_from_torch
from nanoserve.validation import check_int

DEVICE_CATEGORIES = ("compute", "comm", "memcpy")   # in the order that wins where they overlap


@contextlib.contextmanager
def region(name: str):
    """Label the host work inside the `with` block as `name` ("data", "tokenize", "h2d", "sampling", ...).

    Outside a profile it costs about a microsecond. Regions nest; the innermost label wins.
    """
    name = str(name)
    if not name or name in DEVICE_CATEGORIES + ("host", "idle") or "\n" in name:
        raise ValueError(f"region name {name!r} must be a non-empty line and not one of the analysis's own "
                         f"categories {DEVICE_CATEGORIES + ('host', 'idle')}")
    with torch.profiler.record_function(REGION_PREFIX + name):
        yield


@dataclass(frozen=True)
class OpStat:
    """One operator (or kernel) name's totals over a profile, placed on a roofline."""

    name: str
    calls: int
    seconds: float           # device time (self time of host operators on a CPU trace)
    flops: float
    bytes: float
    intensity: float | None  # FLOP per byte; None without a FLOP count
    attained: float | None   # FLOP/s reached; None without a FLOP count
    bound: str | None        # "compute" or "memory" on the hardware row; None without a FLOP count


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _inside(intervals: list[tuple[float, float]], starts: list[float], t: float) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and intervals[i][0] <= t < intervals[i][1]


class Profile:
    """The analysis of one trace: a list of `Event` records and the wall window they are judged in.

    `device` is "cpu" (the compute thread `compute_lane` plays the accelerator) or "cuda" (device
    records on streams are the accelerator; host ops are host work). `result` is what the profiled
    function returned; `torch_profiler` the raw profiler, kept for `export_chrome_trace`.
    """

    def __init__(self, events: list[Event], window: tuple[float, float] | None = None, *,
                 compute_lane: str, device: str = "cpu", result=None, torch_profiler=None):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: expected 'cpu' or 'cuda'")
        self.events = sorted(events, key=lambda e: (e.start_s, -e.dur_s))
        if window is None:
            if not self.events:
                raise ValueError("an empty trace needs an explicit window (start_s, end_s)")
            window = (min(e.start_s for e in self.events), max(e.end_s for e in self.events))
        self.window = (float(window[0]), float(window[1]))
        if self.window[1] <= self.window[0]:
            raise ValueError(f"window {self.window} is empty: it must end after it starts")
        self.compute_lane, self.device, self.result = compute_lane, device, result
        self.torch_profiler = torch_profiler
        self.cpu_threads: int | None = None   # intra-op threads the profiled call ran with (CPU traces)
        self._sweep()

    # --- the sweep: classify every instant of the window ------------------------------------------
    def _host_regions(self) -> list[Event]:
        return [e for e in self.events if e.kind == "region" and e.lane == self.compute_lane]

    def _sweep(self) -> None:
        t0, t1 = self.window
        marks = []  # (time, order, kind, key, delta): ends sort before starts at the same instant
        for i, e in enumerate(self.events):
            a, b = max(e.start_s, t0), min(e.end_s, t1)
            if b <= a:
                continue
            if e.kind == "region":
                if e.lane != self.compute_lane:
                    continue
                marks += [(a, 1, "region", i, +1), (b, 0, "region", i, -1)]
            elif e.kind == "device":
                marks += [(a, 1, "dev", e.category, +1), (b, 0, "dev", e.category, -1)]
            elif e.lane == self.compute_lane:
                marks += [(a, 1, "op", e.category, +1), (b, 0, "op", e.category, -1)]
        marks.sort(key=lambda m: (m[0], m[1]))
        dev = dict.fromkeys(DEVICE_CATEGORIES, 0)
        ops = dict.fromkeys(DEVICE_CATEGORIES, 0)
        open_regions: dict[int, float] = {}
        parts: dict[str, float] = {}
        busy_by = dict.fromkeys(DEVICE_CATEGORIES, 0.0)
        busy = overlap = 0.0
        lanes: dict[str, list[tuple[float, float]]] = {}   # category -> segments, for the timeline
        last = t0
        for t, _, kind, key, delta in marks + [(t1, 0, "end", None, 0)]:
            seg = t - last
            if seg > 0:
                in_region = bool(open_regions)
                # On a CPU trace the compute thread's ops outside regions are the device's work.
                active = {c: dev[c] + (ops[c] if self.device == "cpu" and not in_region else 0)
                          for c in DEVICE_CATEGORIES}
                cat = next((c for c in DEVICE_CATEGORIES if active[c] > 0), None)
                if cat is not None:
                    busy += seg
                    for c in DEVICE_CATEGORIES:
                        busy_by[c] += seg if active[c] > 0 else 0.0
                    overlap += seg if active["compute"] > 0 and active["comm"] > 0 else 0.0
                elif in_region:
                    inner = max(open_regions, key=lambda j: (open_regions[j], j))
                    cat = self.events[inner].category
                elif any(ops.values()):
                    cat = "host"
                else:
                    cat = "idle"
                parts[cat] = parts.get(cat, 0.0) + seg
                lanes.setdefault(cat, []).append((last, t))
            last = max(last, t)
            if kind == "region":
                if delta > 0:
                    open_regions[key] = t
                else:
                    open_regions.pop(key, None)
            elif kind == "dev":
                dev[key] += delta
            elif kind == "op":
                ops[key] += delta
        self._parts, self._busy_s, self._busy_by, self._overlap_s = parts, busy, busy_by, overlap
        self._segments = {c: _union(s) for c, s in lanes.items()}

    # --- the numbers ------------------------------------------------------------------------------
    @property
    def wall_s(self) -> float:
        """Seconds from the start to the end of the profiled call."""
        return self.window[1] - self.window[0]

    @property
    def busy_s(self) -> float:
        """Seconds in which the accelerator (or the compute thread standing in for it) was working."""
        return self._busy_s

    @property
    def busy_fraction(self) -> float:
        """Accelerator busy time / wall time, between 0 and 1."""
        return self._busy_s / self.wall_s

    def breakdown(self) -> dict[str, float]:
        """Seconds per category, summing to `wall_s`, in a fixed order: "compute", "comm", "memcpy"
        (always present), then the region labels seen (alphabetically), "host" (if any) and "idle"."""
        out = {c: self._parts.get(c, 0.0) for c in DEVICE_CATEGORIES}
        for c in sorted(set(self._parts) - set(DEVICE_CATEGORIES) - {"host", "idle"}):
            out[c] = self._parts[c]
        if "host" in self._parts:
            out["host"] = self._parts["host"]
        out["idle"] = self._parts.get("idle", 0.0)
        return out

    def busy_by_category(self) -> dict[str, float]:
        """Seconds in which each kind of device work ran; overlapping kinds both count (unlike breakdown)."""
        return dict(self._busy_by)

    @property
    def comm_s(self) -> float:
        return self._busy_by["comm"]

    @property
    def overlap_s(self) -> float:
        """Seconds in which communication and compute ran at the same time."""
        return self._overlap_s

    @property
    def overlap_fraction(self) -> float | None:
        """Share of communication time hidden under compute (None when there was no communication)."""
        return self._overlap_s / self.comm_s if self.comm_s > 0 else None

    def _device_work(self) -> list[tuple[Event, float]]:
        """(event, seconds) of the accelerator's work: device records on a GPU trace; on a CPU trace the
        compute thread's operators outside regions, each counted by its self time (without nested ops)."""
        if self.device == "cuda" or any(e.kind == "device" and e.lane.startswith("stream") for e in self.events):
            return [(e, e.dur_s) for e in self.events if e.kind == "device"]
        regions = _union((e.start_s, e.end_s) for e in self._host_regions())
        starts = [a for a, _ in regions]
        ops = [e for e in self.events if e.kind == "op" and e.lane == self.compute_lane]
        child = [0.0] * len(ops)
        stack: list[int] = []
        for i, e in enumerate(ops):   # sorted by start, longest first: parents come before children
            while stack and ops[stack[-1]].end_s <= e.start_s:
                stack.pop()
            if stack and e.end_s <= ops[stack[-1]].end_s + 1e-12:
                child[stack[-1]] += e.dur_s
            stack.append(i)
        return [(e, max(e.dur_s - c, 0.0)) for e, c in zip(ops, child)
                if not _inside(regions, starts, e.start_s)]

    def top_ops(self, n: int = 10, hardware=None, dtype: str | None = None) -> list[OpStat]:
        """The `n` operators (kernels on a GPU) with the most device time, with FLOPs, bytes, arithmetic
        intensity, attained FLOP/s and roofline bound on `hardware` (a `perf.Hardware` row; default: this
        machine's measured ceilings, `perf.measure_ceilings()`). `dtype` picks the peak ("fp32"/"bf16");
        default fp32 on a CPU trace and bf16 on a GPU trace."""
        from nanoserve.perf.hardware import measure_ceilings

        totals: dict[str, list[float]] = {}
        for e, s in self._device_work():
            key = e.op or e.name if e.kind == "device" and e.lane.startswith("stream") else e.name
            t = totals.setdefault(key, [0, 0.0, 0.0, 0.0])
            t[0] += 1
            t[1] += s
            t[2] += e.flops
            t[3] += e.bytes
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
        hw = hardware
        if hw is None and any(t[2] > 0 for _, t in ranked):
            hw = measure_ceilings(device="cpu" if self.device == "cpu" else None)
        dtype = dtype or ("fp32" if self.device == "cpu" or hw is None or hw.bf16_flops is None else "bf16")
        stats = []
        for name, (calls, secs, flops, nbytes) in ranked:
            if flops > 0 and nbytes > 0 and secs > 0:
                intensity = flops / nbytes
                bound = "compute" if intensity >= hw.ridge_point(dtype) else "memory"
                stats.append(OpStat(name, int(calls), secs, flops, nbytes, intensity, flops / secs, bound))
            else:
                stats.append(OpStat(name, int(calls), secs, flops, nbytes, None, None, None))
        return stats

    # --- showing and exporting ------------------------------------------------------------------
    def summary(self) -> str:
        """A few lines: wall time, busy fraction, breakdown, overlap."""
        from nanoserve.perf.timing import format_seconds

        who = "CUDA streams" if self.device != "cpu" else (
            "compute thread" + (f", {self.cpu_threads} intra-op thread{'s' * (self.cpu_threads > 1)}"
                                if self.cpu_threads else ""))
        lines = [f"wall {format_seconds(self.wall_s)}, accelerator busy {self.busy_fraction:.0%} ({who})"]
        for cat, s in self.breakdown().items():
            lines.append(f"  {cat:<10} {format_seconds(s):>10}  {s / self.wall_s:6.1%}")
        if self.overlap_fraction is not None:
            lines.append(f"  communication overlapped with compute: {self.overlap_fraction:.0%}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Profile {self.device}: wall {self.wall_s:.4g} s, busy {self.busy_fraction:.1%}, {len(self.events)} events>"

    def timeline(self) -> list[tuple[str, dict[str, list[tuple[float, float]]]]]:
        """Rows of the timeline, top to bottom: (label, {category: merged (start_s, end_s) spans}).

        First what the wall time went to (the breakdown, instant by instant), then every host thread's
        labelled regions and every device lane's work, and the compute thread's operators."""
        lanes: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for e in self.events:
            if e.kind == "region":
                label = f"regions, {e.lane}"
            elif e.kind == "device":
                label = f"device, {e.lane}"
            elif e.lane == self.compute_lane:
                label = "ops, compute thread" if self.device == "cpu" else f"host ops, {e.lane}"
            else:
                continue
            lanes.setdefault(label, {}).setdefault(e.category, []).append((e.start_s, e.end_s))
        rows = [(label, {c: _union(spans) for c, spans in cats.items()}) for label, cats in sorted(lanes.items())]
        return [("wall time went to", dict(self._segments))] + rows

    # Plots take the numbers they draw from here; profile_plots never imports this module.
    def plot_timeline(self, ax=None):
        from nanoserve.perf.profile_plots import plot_timeline
        return plot_timeline(self.timeline(), self.window, self.busy_fraction, ax=ax)

    def plot_breakdown(self, ax=None):
        from nanoserve.perf.profile_plots import plot_breakdown
        return plot_breakdown(self.breakdown(), self.wall_s, ax=ax)

    def plot_roofline(self, n: int = 8, hardware=None, dtype: str | None = None, ax=None):
        """The top operators that have a FLOP count, on the roofline of `hardware` (default: measured here)."""
        from nanoserve.perf.hardware import measure_ceilings
        from nanoserve.perf.profile_plots import plot_top_ops_roofline

        stats = [s for s in self.top_ops(n=n, hardware=hardware, dtype=dtype) if s.intensity is not None]
        if not stats:
            raise ValueError("no operator in this profile has a FLOP count (torch.utils.flop_counter knows "
                             "matmuls, convolutions and attention): nothing to place on a roofline")
        hw = hardware or measure_ceilings(device="cpu" if self.device == "cpu" else None)
        dtype = dtype or ("fp32" if self.device == "cpu" or hw.bf16_flops is None else "bf16")
        return plot_top_ops_roofline(stats, hw, dtype, ax=ax)

    def export_chrome_trace(self, path) -> str:
        """Write the trace as Chrome trace JSON (open it in https://ui.perfetto.dev or chrome://tracing).

        The raw torch.profiler trace when there is one (every op, shape and kernel), else these records."""
        path = str(path)
        if self.torch_profiler is not None:
            self.torch_profiler.export_chrome_trace(path)
            return path
        rows = [{"name": e.name, "cat": e.category, "ph": "X", "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6,
                 "pid": 0 if e.lane.startswith("thread") else 1, "tid": e.lane,
                 "args": {"kind": e.kind, "op": e.op, "flops": e.flops, "bytes": e.bytes}} for e in self.events]
        with open(path, "w") as f:
            json.dump({"traceEvents": rows, "displayTimeUnit": "ms"}, f)
        return path


def profile(fn: Callable, *args, device: str | torch.device | None = None, cpu_threads: int | None = 1,
            **kwargs) -> Profile:
    """Run `fn(*args, **kwargs)` once under torch.profiler and return its analysis (a `Profile`).

    CPU activities are always recorded, CUDA ones when `device` (default `perf.device()`) is a GPU.
    Warm up before profiling: the first call of anything pays one-time costs. The call's return value
    is `prof.result`. Shapes are recorded (for FLOPs and bytes), which costs a few microseconds per op.

    On a CPU the compute thread plays the accelerator, so by default the call runs with ONE intra-op thread
    (`cpu_threads=1`; restored afterwards; `prof.cpu_threads` says what ran). With a team of threads, another
    process on the machine stalls the whole team at every barrier whenever it preempts one member: each operator
    then takes several times longer while labelled host work (one thread) barely slows, and the busy fraction
    says more about the neighbours than about the job. With one thread both slow alike and the fractions hold.
    `cpu_threads=None` keeps the caller's setting. Ignored on a GPU.
    """
    from torch.profiler import ProfilerActivity

    dev = _device(device)
    check_int("cpu_threads", cpu_threads, none_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    tid = threading.get_native_id()
    before = torch.get_num_threads()
    threads = cpu_threads if dev.type == "cpu" and cpu_threads is not None else before
    sync(dev)
    try:
        torch.set_num_threads(threads)
        with torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True) as prof:
            with torch.profiler.record_function(WINDOW_NAME):
                result = fn(*args, **kwargs)
                sync(dev)
    finally:
        torch.set_num_threads(before)
    events, window = events_from_torch(prof, tid)
    out = Profile(events, window, compute_lane=f"thread {tid}", device=dev.type, result=result,
                  torch_profiler=prof)
    out.cpu_threads = threads if dev.type == "cpu" else None
    return out
