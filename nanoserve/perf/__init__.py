"""Measuring: device choice, timing, peak memory, hardware ceilings and the roofline."""
from nanoserve.perf.device import device, sync

__all__ = ["device", "sync"]
