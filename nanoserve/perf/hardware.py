"""The ceilings of real hardware: peak FLOP/s, memory bandwidth, memory size, interconnect.

`HARDWARE` holds vendor datasheet numbers (dense, i.e. without 2:4 sparsity) for accelerators the
course talks about. `INTERCONNECTS` holds the links between them (NVLink, PCIe, InfiniBand): the
bandwidth of one direction, which is the ring model's beta (see `nanoserve.perf.comm`), and a typical
latency of one ring step, its alpha. `measure_ceilings()` measures the ceilings of the machine you are on and
returns them as a row of the same kind, once per process: a ceiling is a fact about this machine now, so it is never
read back from an earlier run (a noisy first run, or another machine sharing a home directory, would poison every
later lesson). `kernel_ceiling()` measures the roof of one particular kernel at the shape a lesson uses.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.device import device as _device
from nanoserve.perf.timing import timeit

T, G = 1e12, 1e9


@dataclass(frozen=True)
class Hardware:
    """One machine's ceilings. FLOP/s are dense peaks; bandwidths are bytes/s; sizes are bytes."""

    name: str
    bf16_flops: float | None     # peak dense bf16/fp16 matmul FLOP/s (tensor cores), None if unknown
    fp32_flops: float            # peak fp32 FLOP/s without tensor cores / matrix units
    mem_bw: float                # main-memory bandwidth, bytes/s
    mem_bytes: float             # main-memory capacity, bytes
    interconnect: str            # how several of them talk to each other
    interconnect_bw: float | None  # bytes/s per device, as the vendor quotes it (often both directions)
    source: str                  # where the numbers come from
    interconnect_latency_s: float | None = None  # typical latency of one step of a collective over it, s

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for `dtype` ("bf16", "fp16" or "fp32")."""
        if dtype in ("bf16", "fp16", "bfloat16", "float16"):
            if self.bf16_flops is None:
                raise ValueError(f"{self.name!r} has no bf16/fp16 peak (not published or not measured); use dtype='fp32'")
            return self.bf16_flops
        if dtype in ("fp32", "float32"):
            return self.fp32_flops
        raise ValueError(f"dtype {dtype!r} is not known: expected 'bf16', 'fp16' or 'fp32'")

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOP per byte at which compute time equals memory time: below it a kernel is memory bound."""
        return self.peak_flops(dtype) / self.mem_bw


# Typical latency of one ring step (the alpha of nanoserve.perf.comm), by kind of link. No datasheet gives
# these; they are round numbers of the order NCCL's own cost model uses (NVIDIA/nccl, src/graph/tuning.cc,
# hwLat, Ring: NVLink 0.47-3.4 us, PCI 1.0-5.7 us, network 2.7-9.6 us per step, by protocol; plus a fixed
# 3.6-10 us per call, baseLat). Order of magnitude, not precision: fit your own with perf.measure_collective.
NVLINK_LAT, PCIE_LAT, NET_LAT = 1e-6, 2e-6, 5e-6
_NCCL_TUNING = "NCCL's cost model, https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc (hwLat)"


@dataclass(frozen=True)
class Interconnect:
    """A link between accelerators, as the ring cost model sees it.

    bw: bytes/s in ONE direction per device (vendors often quote both directions added: NVLink 4's
    "900 GB/s" is 450 GB/s each way); this is beta, and what nccl-tests' bus bandwidth approaches.
    latency_s: a typical latency of one ring step (alpha): a round number, not a measured one.
    """

    name: str
    bw: float
    latency_s: float
    source: str

    def collective_time(self, op: str, nbytes: float, world_size: int) -> float:
        """The ring model's seconds for `op` on `nbytes` over `world_size` devices joined by this link."""
        from nanoserve.perf.comm import collective_time
        return collective_time(op, nbytes, world_size, self.latency_s, self.bw)


INTERCONNECTS: dict[str, Interconnect] = {i.name: i for i in [
    Interconnect("NVLink 4 (H100/H200 SXM)", 450 * G, NVLINK_LAT,
                 "NVIDIA H100 / H200 datasheets and https://www.nvidia.com/en-us/data-center/nvlink/ "
                 "(900 GB/s per GPU, both directions, 18 links); latency typical, after " + _NCCL_TUNING),
    Interconnect("NVLink 3 (A100 SXM)", 300 * G, NVLINK_LAT,
                 "NVIDIA A100 datasheet (600 GB/s per GPU, both directions, 12 links); latency typical, after "
                 + _NCCL_TUNING),
    Interconnect("PCIe Gen5 x16", 64 * G, PCIE_LAT,
                 "PCI-SIG PCI Express Base Specification 5.0, https://pcisig.com/specifications "
                 "(32 GT/s x 16 lanes, 128b/130b: about 63 GB/s each direction; 128 GB/s both); latency typical, "
                 "after " + _NCCL_TUNING),
    Interconnect("PCIe Gen4 x16", 32 * G, PCIE_LAT,
                 "PCI-SIG PCI Express Base Specification 4.0, https://pcisig.com/specifications "
                 "(16 GT/s x 16 lanes: about 32 GB/s each direction); latency typical, after " + _NCCL_TUNING),
    Interconnect("InfiniBand NDR 400 Gb/s", 50 * G, NET_LAT,
                 "NVIDIA Quantum-2 InfiniBand / ConnectX-7, https://www.nvidia.com/en-us/networking/quantum2/ "
                 "(400 Gb/s per port = 50 GB/s each direction; one port per GPU in a DGX H100); latency typical "
                 "end to end through NCCL, after " + _NCCL_TUNING),
]}


HARDWARE: dict[str, Hardware] = {h.name: h for h in [
    Hardware("H100 SXM", 989.4 * T, 66.9 * T, 3.35e12, 80e9, "NVLink 4 (18 links)", 900 * G,
             "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/ "
             "(BF16 1,979 TFLOPS is with sparsity; dense is half)",
             interconnect_latency_s=NVLINK_LAT),
    Hardware("H200 SXM", 989.4 * T, 66.9 * T, 4.8e12, 141e9, "NVLink 4 (18 links)", 900 * G,
             "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ "
             "(same GH100 compute as H100 SXM; BF16 1,979 TFLOPS is with sparsity)",
             interconnect_latency_s=NVLINK_LAT),
    Hardware("A100 80GB SXM", 312 * T, 19.5 * T, 2.039e12, 80e9, "NVLink 3 (12 links)", 600 * G,
             "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/",
             interconnect_latency_s=NVLINK_LAT),
    Hardware("L4", 121 * T, 30.3 * T, 300e9, 24e9, "PCIe Gen4 x16 (no NVLink)", 64 * G,
             "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/ "
             "(BF16 242 TFLOPS is with sparsity)",
             interconnect_latency_s=PCIE_LAT),
    Hardware("RTX 4090", 165.2 * T, 82.6 * T, 1008e9, 24e9, "PCIe Gen4 x16 (no NVLink)", 64 * G,
             "NVIDIA Ada Lovelace GPU Architecture whitepaper, appendix A "
             "(BF16/FP16 tensor with FP32 accumulate; 330 TFLOPS is FP16 accumulate)",
             interconnect_latency_s=PCIE_LAT),
    Hardware("MI300X", 1307.4 * T, 81.7 * T, 5.3e12, 192e9, "AMD Infinity Fabric (7 links)", 896 * G,
             "AMD Instinct MI300X data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html "
             "(fp32 is vector; matrix fp32 is 163.4 TFLOPS; no interconnect latency: AMD publishes none)"),
    Hardware("DGX Spark", 125 * T, 31 * T, 273e9, 128e9, "ConnectX-7 200 GbE (two units)", 25 * G,
             "NVIDIA DGX Spark product page, https://www.nvidia.com/en-us/products/workstations/dgx-spark/ "
             "(1 PFLOP FP4 with sparsity; bf16 dense derived as 1/8 of that, not published; "
             "fp32 ~31 TFLOPS from NVIDIA's Hot Chips 2025 GB10 talk; 128 GB LPDDR5x shared by CPU and GPU)",
             interconnect_latency_s=NET_LAT),
]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _matmul_flops(n: int, dtype: torch.dtype, dev: torch.device, budget_s: float = 1.0) -> float:
    """Best FLOP/s of an n x n x n matmul (2*n^3 FLOPs per run).

    Where the kernel is very slow (bf16 on a CPU without bf16 units runs a plain loop, under a GFLOP/s: 20 s for
    the six runs at 1024), n is halved until the runs fit in about `budget_s`, judged from a 256^3 probe. Such a
    kernel stays far below the fast kernels' rate at any size (the best of its sizes is kept as its ceiling);
    a fast one keeps n."""
    probe = torch.randn(256, 256, device=dev).to(dtype)
    probe_s = timeit(torch.matmul, probe, probe, warmup=1, repeat=2, device=dev).min_s
    while n > 256 and 6 * probe_s * (n / 256) ** 3 > budget_s:
        n //= 2
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    t = timeit(torch.matmul, a, b, out=out, warmup=1, repeat=5, device=dev)
    return 2 * n**3 / t.min_s


# Copy buffers for the bandwidth ceiling. On a CPU the copy touches twice this (source and destination): 1 GiB,
# twice the largest last-level cache a VM here reports (480 MiB), so every byte comes from DRAM, not cache.
CPU_COPY_BYTES = 512 << 20
GPU_COPY_BYTES = 1 << 30


def _copy_bw(nbytes: int, dev: torch.device) -> float:
    """Best bytes/s of copying a buffer of `nbytes`, counting the read and the write.

    The best of 9 timed copies (after 2 warm-ups): a ceiling is what the machine reaches when nothing else
    gets in the way; on a shared machine the slow runs measure the neighbours, not the memory.
    """
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = timeit(dst.copy_, src, warmup=2, repeat=9, device=dev)
    return 2 * src.numel() * 4 / t.min_s


# Measured ceilings of this process, by (device, threads). Never written to disk: see the module's docstring.
_MEASURED: dict[tuple[str, int], Hardware] = {}


def measure_ceilings(force: bool = False, device: str | torch.device | None = None) -> Hardware:
    """Measure this machine's fp32 and bf16 matmul FLOP/s and memory copy bytes/s; return them as a `Hardware` row.

    The best of a few runs is kept (a ceiling is what the machine can reach, not what it usually does).
    Measured once per process and device (and per `torch.get_num_threads()`: one thread and two are different
    machines to a kernel); `force=True` measures again. On a CPU the bf16 matmul is whatever the machine's
    kernels make of it: with bf16 dot-product units (AVX512-BF16, AMX) it can beat fp32, without them it is
    converted and slower. Takes a few seconds on a 2-core CPU.
    """
    dev = _device(device)
    key = (str(dev), torch.get_num_threads())
    if key in _MEASURED and not force:
        return _MEASURED[key]
    torch.manual_seed(0)
    on_gpu = dev.type == "cuda"
    n = 8192 if on_gpu else 1024
    fp32 = _matmul_flops(n, torch.float32, dev)
    bf16 = _matmul_flops(n, torch.bfloat16, dev)
    bw = _copy_bw(GPU_COPY_BYTES if on_gpu else CPU_COPY_BYTES, dev)
    if on_gpu:
        props = torch.cuda.get_device_properties(dev)
        name, mem = f"this machine ({props.name})", float(props.total_memory)
        what = props.name
    else:
        name, mem = f"this machine ({dev.type})", float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        what = f"{_cpu_model()}, {torch.get_num_threads()} threads"
    row = Hardware(name, bf16, fp32, bw, mem, "n/a (measured)", None,
                   f"measured by nanoserve.perf.measure_ceilings in this process ({what}, torch {torch.__version__})")
    _MEASURED[key] = row
    return row


@dataclass(frozen=True)
class KernelCeiling:
    """What one kernel reaches at one shape: its best time, and the FLOP/s and bytes/s that time means."""

    seconds: float        # best of the timed runs
    flops: float          # FLOPs of one call
    nbytes: float         # bytes one call must move (the caller's count)

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds

    def time_for(self, flops: float) -> float:
        """Seconds this kernel needs for `flops` FLOPs at the rate it reached (for compute-bound predictions)."""
        return flops / self.flops_per_s


def kernel_ceiling(fn: Callable[[], object], *, flops: float, nbytes: float, repeat: int = 5, warmup: int = 1,
                   device: str | torch.device | None = None) -> KernelCeiling:
    """The roof of one kernel, here: the best of `repeat` timed calls of `fn()` (after `warmup`), with the FLOPs
    and bytes of one call, so a lesson can predict from what *this* kernel reaches on *this* machine (an int8
    weight-only matmul, a bf16 GEMM) rather than from the fp32 peak or from another chip's numbers."""
    if flops <= 0 and nbytes <= 0:
        raise ValueError("kernel_ceiling: give the call's flops or nbytes (both are <= 0)")
    t = timeit(fn, warmup=warmup, repeat=repeat, device=_device(device))
    return KernelCeiling(t.min_s, float(flops), float(nbytes))
