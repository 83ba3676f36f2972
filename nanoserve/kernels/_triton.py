"""`triton` and `triton.language`, or stand-ins where no Triton wheel exists (macOS, Windows).

The kernel modules keep each Triton kernel next to its PyTorch reference. The references must work
on every laptop, so a missing Triton may not break `import`: the stand-ins let the `@triton.jit`
definitions load, and any attempt to launch one says what is missing.
"""
from __future__ import annotations

import os

import torch


def _import_triton():
    """Import Triton; where torch sees no GPU, with its interpreter on and os.environ left unchanged.

    `@triton.jit` picks compile or interpret when a kernel is defined (Triton's own helpers are
    defined when triton is imported), and the interpreter checks the setting again at launch. The
    setting is read from TRITON_INTERPRET unless set in `triton.knobs`; setting the knob keeps it
    for this process, so the variable is put back as it was (child processes do not inherit it).
    """
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        import triton
        return triton
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        triton.knobs.runtime.interpret = True
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    return triton


try:
    triton = _import_triton()
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    def _unavailable(*args, **kwargs):
        raise RuntimeError("Triton is not installed (it ships wheels for Linux x86-64 only); "
                           "use NANOSERVE_KERNELS=torch or auto for the PyTorch references")

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return _unavailable

    class _MissingTriton:
        """Enough of triton / triton.language for kernel definitions to load; nothing runs."""

        def jit(self, fn=None, **kwargs):
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        def __getattr__(self, name):  # tl.constexpr in annotations, triton.cdiv in wrappers, ...
            return _unavailable

    triton = tl = _MissingTriton()

__all__ = ["triton", "tl", "HAVE_TRITON"]
