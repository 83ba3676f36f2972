"""Measuring: device choice, timing, peak memory, hardware ceilings and the roofline."""
from nanoserve.perf.device import device, sync
from nanoserve.perf.hardware import HARDWARE, Hardware, measure_ceilings
from nanoserve.perf.memory import ChildPeak, PeakMemory, child_peak_rss, device_peak_bytes, peak_memory, peak_rss_bytes
from nanoserve.perf.profile import OpStat, Profile, profile, region
from nanoserve.perf.roofline import Roofline, plot_roofline, roofline
from nanoserve.perf.timing import Timing, format_seconds, timeit
from nanoserve.perf.trace import Event

__all__ = [
    "device", "sync",
    "Timing", "timeit", "format_seconds",
    "peak_rss_bytes", "child_peak_rss", "device_peak_bytes", "peak_memory", "ChildPeak", "PeakMemory",
    "HARDWARE", "Hardware", "measure_ceilings",
    "Roofline", "roofline", "plot_roofline",
    "profile", "region", "Profile", "OpStat", "Event",
]
