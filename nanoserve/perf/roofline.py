"""The roofline model: a kernel takes at least max(FLOPs / peak FLOP/s, bytes / bandwidth).

Arithmetic intensity (FLOP per byte moved) decides which term wins. The ridge point is the intensity
where both are equal: below it the kernel waits on memory, above it on the arithmetic units.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanoserve.perf.hardware import Hardware


@dataclass(frozen=True)
class Roofline:
    """The roofline prediction for one piece of work on one machine."""

    flops: float                 # floating-point operations (a multiply-add counts as 2)
    bytes: float                 # bytes moved to and from main memory
    hardware: str                # the machine's name
    dtype: str                   # which peak was used
    compute_s: float             # flops / peak FLOP/s
    memory_s: float              # bytes / bandwidth
    arithmetic_intensity: float  # FLOP per byte
    ridge_point: float           # FLOP per byte where compute_s == memory_s

    @property
    def predicted_s(self) -> float:
        """The floor on run time, in seconds: the slower of the two resources."""
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """'memory' below the ridge point, 'compute' at or above it."""
        return "compute" if self.arithmetic_intensity >= self.ridge_point else "memory"


def roofline(flops: float, bytes: float, hw: Hardware, dtype: str = "bf16") -> Roofline:
    """Predict the minimum time of work doing `flops` FLOPs and moving `bytes` bytes on `hw`."""
    if flops < 0 or bytes <= 0:
        raise ValueError(f"roofline needs flops >= 0 and bytes > 0, got flops={flops}, bytes={bytes}")
    peak = hw.peak_flops(dtype)
    return Roofline(flops=flops, bytes=bytes, hardware=hw.name, dtype=dtype,
                    compute_s=flops / peak, memory_s=bytes / hw.mem_bw,
                    arithmetic_intensity=flops / bytes, ridge_point=peak / hw.mem_bw)


def plot_roofline(hw: Hardware, points=(), ax=None, dtype: str = "bf16"):
    """Log-log roofline of `hw` with measured points.

    `points` is an iterable of (name, flops, bytes, measured_seconds). Each is drawn at its arithmetic
    intensity and its attained FLOP/s (flops / seconds); the roof is the best any kernel can attain.
    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    peak, ridge = hw.peak_flops(dtype), hw.ridge_point(dtype)
    points = list(points)
    intensities = [f / b for _, f, b, _ in points] + [ridge]
    x = np.logspace(np.log10(min(intensities) / 4), np.log10(max(intensities) * 16), 200)
    ax.loglog(x, np.minimum(peak, x * hw.mem_bw), color="black", lw=2, label=f"{hw.name} roof ({dtype})")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.text(ridge, 0.03, f" ridge {ridge:.3g} FLOP/byte", transform=ax.get_xaxis_transform(), color="gray", fontsize=8)
    for name, f, b, s in points:
        ax.loglog(f / b, f / s, "o")
        ax.annotate(name, (f / b, f / s), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attained throughput (FLOP / s)")
    ax.set_title(f"Roofline: {hw.name}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right")
    return ax
