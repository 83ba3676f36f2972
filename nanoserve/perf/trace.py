"""A profile as a list of plain event records, built from torch.profiler or by hand.

The analysis (`nanoserve.perf.profile.Profile`) reads nothing but these records, so the same code
judges a CPU trace, a CUDA trace, and a synthetic trace written in a test on a machine without a GPU.

    Event(name="ampere_sgemm_128x64", kind="device", category="compute", start_s=0.010,
          dur_s=0.002, lane="stream 7", op="aten::mm", flops=2 * 512**3, bytes=3 * 512 * 512 * 2)

Three kinds of record:
  - "op": a torch operator called on a host thread (lane "thread <tid>");
  - "device": work on the accelerator (a CUDA kernel, memcpy or memset on "stream <id>"), or a
    collective's work on a communication thread (gloo's threads on a CPU machine);
  - "region": a span of host work labelled with `perf.region(name)`; its category is the label.
Categories of ops and device work: "compute", "comm" (collectives) and "memcpy" (copies, memsets).
"""
from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass

REGION_PREFIX = "region:"   # perf.region("data") records a span named "region:data"
KERNEL_PREFIX = "nanoserve::"   # nanoserve's own kernels outside aten (the C paged attention) annotate their calls so
WINDOW_NAME = "nanoserve.profile"  # the span around the profiled call: its ends are the wall window

# torch's own host annotations that are data loading, whether or not the user labelled them
_DATA_ANNOTATIONS = ("enumerate(DataLoader)",)
_COMM = re.compile(r"nccl|gloo|c10d|allreduce|all_reduce|allgather|all_gather|reduce_scatter|"
                   r"reducescatter|broadcast|all_to_all|alltoall|send|recv", re.IGNORECASE)
_RUNTIME = re.compile(r"cu(da)?[A-Z]")     # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...
_COPY_OPS = {"aten::copy_", "aten::to", "aten::_to_copy", "aten::pin_memory", "aten::_pin_memory",
             "aten::fill_", "aten::zero_"}
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "long": 8,
                "int64_t": 8, "int": 4, "short int": 2, "bool": 1, "signed char": 1, "unsigned char": 1,
                "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


@dataclass(frozen=True)
class Event:
    """One record of a trace. Times in seconds from the trace's origin; flops and bytes are counts."""

    name: str
    kind: str               # "op" | "device" | "region"
    category: str           # "compute" | "comm" | "memcpy" for ops and device work; the label for a region
    start_s: float
    dur_s: float
    lane: str               # "thread <tid>" or "stream <id>": where it ran
    op: str | None = None   # for device work: the torch operator that launched it, when known
    flops: float = 0.0      # floating-point operations (a multiply-add is 2)
    bytes: float = 0.0      # bytes read and written, estimated from the operator's tensor shapes

    def __post_init__(self):
        if self.kind not in ("op", "device", "region"):
            raise ValueError(f"event {self.name!r}: kind {self.kind!r} is not 'op', 'device' or 'region'")
        if self.dur_s < 0:
            raise ValueError(f"event {self.name!r}: negative duration {self.dur_s} s")

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def category_of(name: str, activity: str = "cpu_op") -> str:
    """'comm', 'memcpy' or 'compute' for an operator or kernel name (and the profiler's activity type)."""
    if activity in ("gpu_memcpy", "gpu_memset") or name in _COPY_OPS or name.startswith(("Memcpy", "Memset")):
        return "memcpy"
    if _COMM.search(name):
        return "comm"
    return "compute"


def _dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES.get(dtype, 4)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@functools.lru_cache(maxsize=None)
def flop_formula(name: str):
    """torch.utils.flop_counter's formula for an aten operator's name, or None (looked up once per name: a
    server's profile holds hundreds of thousands of operators and a few dozen names)."""
    if not name.startswith("aten::"):
        return None
    import torch
    from torch.utils.flop_counter import flop_registry

    packet = getattr(torch.ops.aten, name[len("aten::"):], None)
    return flop_registry.get(packet) if packet is not None else None


def op_flops(name: str, shapes: list) -> float:
    """FLOPs of an aten operator from torch.utils.flop_counter's formulas (0 for ops it does not count)."""
    formula = flop_formula(name)
    if formula is None:
        return 0.0
    try:
        return float(formula(*[tuple(s) if isinstance(s, list) else s for s in shapes]))
    except Exception:   # a formula needing arguments the trace does not keep: FLOPs unknown
        return 0.0


def op_flops_and_bytes(name: str, shapes: list, dtypes: list) -> tuple[float, float]:
    """`op_flops`, and bytes moved estimated as its tensor inputs read plus its output written."""
    tensors = [(s, d) for s, d in zip(shapes, dtypes) if isinstance(s, (list, tuple)) and len(s) > 0]
    read = sum(_numel(s) * _dtype_bytes(d) for s, d in tensors)
    flops, out_numel = op_flops(name, shapes), max((_numel(s) for s, _ in tensors), default=0)
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") and len(tensors) >= 2:
        a, b = tensors[-2][0], tensors[-1][0]   # output [.., M, N] from [.., M, K] @ [.., K, N]
        out_numel = _numel(a[:-1]) * int(b[-1])
    out_bytes = out_numel * (_dtype_bytes(tensors[0][1]) if tensors else 0)
    return flops, float(read + out_bytes)


def activity_of(k) -> str:
    """Kineto's activity type of a raw record: "cpu_op", "user_annotation", "kernel", "cuda_runtime", ...

    torch before 2.12 has no `activity_type()` (the H200 image's 2.11 does not): there it is inferred
    from the record's device, its name and `is_user_annotation()`, which give the same answer.
    """
    if hasattr(k, "activity_type"):
        return k.activity_type()
    name, annotation = k.name(), bool(getattr(k, "is_user_annotation", lambda: False)())
    if str(k.device_type()).endswith("CUDA"):
        if annotation:
            return "gpu_user_annotation"
        return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
    if _RUNTIME.match(name):
        return "cuda_runtime"
    return "user_annotation" if annotation else "cpu_op"


def events_from_torch(prof, compute_tid: int) -> tuple[list[Event], tuple[float, float] | None]:
    """Records from a finished `torch.profiler.profile`, and the (start, end) of the profiled call.

    Host events keep the native thread id as lane "thread <tid>" (`compute_tid` is the thread that
    called the profiled function). CUDA kernels, memcpys and memsets become "device" records on their
    stream, named after their kernel and tagged with the operator that launched them; gloo's
    collective spans on its own threads become "device" records of category "comm".
    """
    raw = list(prof.profiler.kineto_results.events())
    if not raw:
        return [], None
    origin = min(k.start_ns() for k in raw)
    events, window = [], None
    runtime_by_corr: dict[int, tuple[int, int]] = {}   # launch correlation id -> (thread, start ns)
    op_by_corr: dict[int, tuple[int, int, str, float, float]] = {}  # cpu op correlation id -> the op
    host_ops: dict[int, list[tuple[int, int, str, float, float]]] = {}  # tid -> [(start, end, name, flops, bytes)]
    pending_kernels = []
    for k in raw:
        name, activity = k.name(), activity_of(k)
        start, dur = (k.start_ns() - origin) / 1e9, max(k.duration_ns(), 0) / 1e9
        tid = k.device_resource_id()
        if activity in ("kernel", "gpu_memcpy", "gpu_memset"):
            pending_kernels.append((k, start, dur))
            continue
        if activity in ("cuda_runtime", "cuda_driver"):
            runtime_by_corr[k.correlation_id()] = (tid, k.start_ns())
            continue
        if name == WINDOW_NAME:
            window = (start, start + dur)
            continue
        if activity in ("user_annotation", "cpu_op"):
            if name.startswith(REGION_PREFIX):
                events.append(Event(name, "region", name[len(REGION_PREFIX):], start, dur, f"thread {tid}"))
            elif name.startswith(_DATA_ANNOTATIONS):
                events.append(Event(name, "region", "data", start, dur, f"thread {tid}"))
            elif activity == "user_annotation" and tid != compute_tid and _COMM.search(name):
                # a collective running on a communication thread (gloo): the CPU's "comm stream"
                events.append(Event(name, "device", "comm", start, dur, f"thread {tid}"))
            elif activity == "cpu_op" or name.startswith(KERNEL_PREFIX):   # an operator: compute on this thread
                flops, nbytes = op_flops_and_bytes(name, k.shapes(), k.dtypes())
                flops = flops or float(k.flops() or 0)
                events.append(Event(name, "op", category_of(name), start, dur, f"thread {tid}",
                                    flops=flops, bytes=nbytes))
                row = (k.start_ns(), k.start_ns() + k.duration_ns(), name, flops, nbytes)
                host_ops.setdefault(tid, []).append(row)
                op_by_corr[k.correlation_id()] = row
    # Device work: its launching operator, as torch links them (a kernel's linked correlation id is
    # the operator's id), else the innermost operator around the launch call with the kernel's id.
    for ops in host_ops.values():
        ops.sort()
    per_op_kernels: dict[tuple, list] = {}
    for k, start, dur in pending_kernels:
        owner = op_by_corr.get(k.linked_correlation_id())
        launch = runtime_by_corr.get(k.correlation_id())
        if owner is None and launch is not None:
            tid, t = launch
            ops = host_ops.get(tid, [])
            i = bisect.bisect_right(ops, (t, float("inf"))) - 1
            stop = max(i - 64, -1)   # ops nest shallowly; a launch outside any op is not searched for long
            while i > stop and owner is None:   # the last-started op still open at t is the innermost
                if ops[i][1] >= t:
                    owner = ops[i]
                i -= 1
        per_op_kernels.setdefault(owner, []).append((k, start, dur))
    for owner, kernels in per_op_kernels.items():
        for k, start, dur in kernels:   # an operator's FLOPs and bytes are shared among its kernels
            flops = owner[3] / len(kernels) if owner else 0.0
            nbytes = owner[4] / len(kernels) if owner else 0.0
            events.append(Event(k.name(), "device", category_of(k.name(), activity_of(k)), start, dur,
                                f"stream {k.device_resource_id()}", op=owner[2] if owner else None,
                                flops=flops, bytes=nbytes))
    events.sort(key=lambda e: (e.start_s, -e.dur_s))
    return events, window
