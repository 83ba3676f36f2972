"""Measuring: timing, peak memory, hardware ceilings, the roofline, the profiler, collectives; and, for the
course's notebooks, `device` and `sync` (they live in `nanoserve.device`, which the engine imports instead).

Every other name here loads its module on first use (PEP 562).
"""
import importlib
import sys
import types

from nanoserve.device import device, sync

_LAZY = {   # name -> the module of nanoserve.perf that defines it
    "AlphaBeta": "comm", "CollectiveSweep": "comm", "bus_bandwidth": "comm", "collective_time": "comm",
    "fit_alpha_beta": "comm", "measure_collective": "comm", "plot_collective": "comm",
    "ring_allgather_time": "comm", "ring_allreduce_time": "comm", "ring_reduce_scatter_time": "comm",
    "HARDWARE": "hardware", "Hardware": "hardware", "INTERCONNECTS": "hardware", "Interconnect": "hardware",
    "measure_ceilings": "hardware", "KernelCeiling": "hardware", "kernel_ceiling": "hardware",
    "count_ops": "dispatch", "dispatch_cost": "dispatch",
    "DecodeTimer": "decode", "interleaved_decode": "decode",
    "ChildPeak": "memory", "PeakMemory": "memory", "child_peak_rss": "memory", "device_peak_bytes": "memory",
    "keep_freed_memory": "memory",
    "peak_memory": "memory", "peak_rss_bytes": "memory",
    "OpStat": "profile", "Profile": "profile", "profile": "profile", "region": "profile",
    "Roofline": "roofline", "plot_roofline": "roofline", "roofline": "roofline",
    "Timing": "timing", "format_seconds": "timing", "timeit": "timing",
    "Event": "trace",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    # perf.profile and perf.roofline are functions that share their module's name. Importing a submodule
    # sets it as an attribute of its package, which would hide the function; here the function wins.
    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            return   # perf.<name> stays (or becomes, through __getattr__) the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["device", "sync", *_LAZY]
