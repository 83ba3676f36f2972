"""Names for a profiler's trace: the engine's step and the model's forward are spans a server's profile reads
(`nanoserve.perf.server_profile` attributes wall time to the engine, the model and the kernels by them)."""
from __future__ import annotations

import functools

import torch

STEP_SPAN = "engine.step"
FORWARD_SPAN = "model.forward"


def traced(name: str):
    """Run the decorated function inside a torch.profiler span called `name` (next to nothing when no profiler
    is running)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return call
    return wrap
