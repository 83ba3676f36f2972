"""Measuring: timing, peak memory, hardware ceilings, the roofline, the profiler, collectives; and, for the
course's notebooks, `device` and `sync` (they live in `nanoserve.device`, which the engine imports instead).

The engine never imports this package, so it loads all of it at once (a few milliseconds after torch).
`perf.profile` and `perf.roofline` are functions named like the modules that define them: importing the
modules first and the functions after leaves the functions as the package's attributes.
"""
from nanoserve.device import device, sync
from nanoserve.perf.comm import (AlphaBeta, CollectiveSweep, bus_bandwidth, collective_time, fit_alpha_beta,
                                 measure_collective, plot_collective, ring_allgather_time, ring_allreduce_time,
                                 ring_reduce_scatter_time)
from nanoserve.perf.decode import DecodeTimer, interleaved_decode
from nanoserve.perf.dispatch import count_ops, dispatch_cost
from nanoserve.perf.hardware import (HARDWARE, INTERCONNECTS, Hardware, Interconnect, KernelCeiling, kernel_ceiling,
                                     measure_ceilings)
from nanoserve.perf.memory import (ChildPeak, PeakMemory, child_peak_rss, device_peak_bytes, keep_freed_memory,
                                   peak_memory, peak_rss_bytes, process_peak_rss_bytes)
from nanoserve.perf.profile import OpStat, Profile, profile, region
from nanoserve.perf.roofline import Roofline, plot_roofline, roofline
from nanoserve.perf.timing import Timing, format_seconds, timeit
from nanoserve.perf.trace import Event

__all__ = ["device", "sync",
           "AlphaBeta", "CollectiveSweep", "bus_bandwidth", "collective_time", "fit_alpha_beta", "measure_collective",
           "plot_collective", "ring_allgather_time", "ring_allreduce_time", "ring_reduce_scatter_time",
           "DecodeTimer", "interleaved_decode", "count_ops", "dispatch_cost",
           "HARDWARE", "INTERCONNECTS", "Hardware", "Interconnect", "KernelCeiling", "kernel_ceiling", "measure_ceilings",
           "ChildPeak", "PeakMemory", "child_peak_rss", "device_peak_bytes", "keep_freed_memory", "peak_memory",
           "peak_rss_bytes", "process_peak_rss_bytes", "OpStat", "Profile", "profile", "region", "Roofline",
           "plot_roofline", "roofline",
           "Timing", "format_seconds", "timeit", "Event"]
