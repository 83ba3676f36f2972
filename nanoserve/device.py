"""Which device the course runs on, and how to wait for it.

Every other module asks `device()` instead of writing "cuda": the same code runs on a laptop CPU
and on a GPU, and `NANOSERVE_DEVICE=cpu|cuda` overrides the choice.
"""
from __future__ import annotations

import functools
import os

import torch

_VALID = ("cpu", "cuda")


def device(preferred: str | torch.device | None = None) -> torch.device:
    """The device to run on.

    `preferred` of None or "auto" means: `$NANOSERVE_DEVICE` if set, else cuda when present, else cpu.
    An explicit "cpu", "cuda" or "cuda:N" (or a torch.device) is checked and returned.
    """
    if isinstance(preferred, torch.device):
        preferred = str(preferred)
    if preferred in (None, "auto"):
        preferred = os.environ.get("NANOSERVE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = preferred.split(":")[0]
    if kind not in _VALID:
        raise ValueError(f"device {preferred!r} is not supported: expected 'auto', 'cpu' or 'cuda[:N]'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {preferred!r} was asked for (NANOSERVE_DEVICE or argument) but torch sees no CUDA device")
    return torch.device(preferred)


def sync(dev: str | torch.device | None = None) -> None:
    """Wait until all queued work on the device is done (a no-op on the CPU, where ops run eagerly)."""
    dev = device(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sm_count(dev: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: how many programs a kernel's grid must fill."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
