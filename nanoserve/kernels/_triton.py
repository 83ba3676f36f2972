"""`triton` and `triton.language`, or stand-ins where no Triton wheel exists (macOS, Windows).

The kernel modules keep each Triton kernel next to its PyTorch reference. The references must work
on every laptop, so a missing Triton may not break `import`: the stand-ins let the `@triton.jit`
definitions load, and any attempt to launch one says what is missing.
"""
from __future__ import annotations

try:
    import triton
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
