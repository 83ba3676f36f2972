"""Checks for the exercise notebooks (`solutions/exNN_*.ipynb`, generated into `labs/`).

In an exercise the learner writes one piece of the engine (an RMSNorm, the scheduler's admission rule,
`BlockManager.ensure`, the acceptance rule of speculative decoding); the notebook plugs it into the real
engine and runs the engine's own correctness test with it. `check` runs that, compares what comes out with
the reference, and prints one grader line:

    PASS rmsnorm-layer-by-layer: 6 layers' hidden states match transformers (max |diff| 2.4e-07)
    FAIL rmsnorm-layer-by-layer: layers[2].input_layernorm output[0, 5, 17]: got 0.8123, expected 0.8131 (off by 8.0e-04)
    FAIL rmsnorm-layer-by-layer: not implemented yet (the TODO in your function raised NotImplementedError)

so a learner sees where it first goes wrong: which tensor, which position, by how much. A check never
raises; an exception from the learner's code is a FAIL with its type and message.
"""
from __future__ import annotations

import math
import traceback
from collections.abc import Callable

import torch

from nanoserve.course import grading


def first_mismatch(got, expected, what: str = "output", atol: float = 1e-5, rtol: float = 1e-4) -> str | None:
    """Where `got` first differs from `expected` (tensors, numbers, strings, lists/tuples/dicts of them,
    compared recursively), as one readable line; None when they match within atol + rtol * |expected|."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{what}: expected a tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        if expected.dtype.is_floating_point or got.dtype.is_floating_point:
            g, e = got.detach().double().cpu(), expected.detach().double().cpu()
            bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=False)
        else:
            g, e = got.detach().cpu(), expected.detach().cpu()
            bad = g != e
        if not bad.any():
            return None
        index = tuple(int(i) for i in bad.nonzero()[0])
        at = f"[{', '.join(map(str, index))}]" if index else ""
        a, b = g[index].item(), e[index].item()
        off = f" (off by {abs(a - b):.1e})" if isinstance(a, float) and math.isfinite(a) and math.isfinite(b) else ""
        return f"{what}{at}: got {a:.6g}, expected {b:.6g}{off}; {int(bad.sum())} of {bad.numel()} elements differ"
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{what}: expected a dict, got {type(got).__name__}"
        if set(got) != set(expected):
            return f"{what}: keys {sorted(map(str, got))}, expected {sorted(map(str, expected))}"
        return next((m for k in expected if (m := first_mismatch(got[k], expected[k], f"{what}[{k!r}]", atol, rtol))),
                    None)
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"{what}: expected a list, got {type(got).__name__}"
        for i, (a, b) in enumerate(zip(got, expected)):
            if (m := first_mismatch(a, b, f"{what}[{i}]", atol, rtol)) is not None:
                return m
        if len(got) != len(expected):
            return f"{what}: {len(got)} items, expected {len(expected)} (the first {min(len(got), len(expected))} match)"
        return None
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return None if math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) else \
            f"{what}: got {got:.6g}, expected {expected:.6g}"
    return None if got == expected else f"{what}: got {got!r}, expected {expected!r}"


def _max_abs_diff(got, expected) -> float | None:
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor) and expected.is_floating_point():
        return float((got.detach().double().cpu() - expected.detach().double().cpu()).abs().max()) if got.numel() else 0.0
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        diffs = [d for a, b in zip(got, expected) if (d := _max_abs_diff(a, b)) is not None]
        return max(diffs) if diffs else None
    return None


def check(name: str, compute: Callable[[], object], expected, *, what: str = "output", atol: float = 1e-5,
          rtol: float = 1e-4, passed: str = "matches the reference") -> bool:
    """Run `compute()` (the engine with the learner's piece plugged in) and compare its result with
    `expected` (or `expected()` when callable); print PASS/FAIL `name` with the first mismatch."""
    try:
        got = compute()
    except NotImplementedError:
        grading.check(name, False, "not implemented yet (the TODO in your function raised NotImplementedError)")
        return False
    except Exception as e:   # the learner's code failed: say where, in one line
        frame = traceback.extract_tb(e.__traceback__)[-1]
        grading.check(name, False, f"{type(e).__name__}: {e} (line {frame.lineno} of {frame.name})")
        return False
    reference = expected() if callable(expected) else expected
    mismatch = first_mismatch(got, reference, what, atol, rtol)
    diff = _max_abs_diff(got, reference)
    detail = mismatch or (passed + ("" if diff is None else f" (max |diff| {diff:.1e})"))
    grading.check(name, mismatch is None, detail)
    return mismatch is None
