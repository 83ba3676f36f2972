"""The busy fraction under a competing process (the measuring phase of `make test`, with nothing beside it).

The diagnosis of every lab rests on `perf.profile`'s busy fraction, and a learner's machine is rarely quiet: a second
process using every core must not turn a starved job into a busy one. The test compares the job's busy fraction on
a quiet machine with its busy fraction beside spinning processes, so it must run with nothing else beside it: in the
unit phase the other pytest worker's load came and went between the two measurements (quiet 0.37, loaded 0.19).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from nanoserve import perf

_SPINNER = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


def _count(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def _starved_job():
    """A job starved by labelled host work: Python in a data region between a few small matmuls. The Python is fixed
    work, not a fixed time, so a busy machine slows it like the ops; its size is set once, on this CPU, to about three
    times the ops' time, so the job is starved (busy near 25%) whatever the ratio of this CPU's matmul to its Python."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # perf.profile runs the ops on one thread on a CPU
    try:
        a @ b
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        matmul_s = (time.perf_counter() - start) / 4
    finally:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    _count(200_000)
    per_step = (time.perf_counter() - start) / 200_000
    steps = max(50_000, int(3 * 2 * matmul_s / per_step))

    def job():
        for _ in range(8):
            with perf.region("data"):
                _count(steps)
            for _ in range(2):
                a @ b
    return job


def _median_busy(job, runs: int = 3) -> float:
    return sorted(perf.profile(job).busy_fraction for _ in range(runs))[runs // 2]


@pytest.mark.slow
def test_the_busy_fraction_holds_while_another_process_competes_for_the_cores():
    """With the compute thread as the only intra-op thread (perf.profile's default on a CPU), the ops and the
    labelled host work slow down alike, so the starved job reads starved beside spinning processes too."""
    import subprocess
    import sys

    job = _starved_job()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))   # the caller's setting: a team of threads, as in most notebooks
    try:
        job()
        quiet = _median_busy(job)
        spinners = [subprocess.Popen([sys.executable, "-c", _SPINNER]) for _ in range(os.cpu_count() or 2)]
        try:
            time.sleep(0.2)
            loaded = _median_busy(job)
        finally:
            for p in spinners:
                p.kill()
            for p in spinners:
                p.wait(timeout=10)
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    assert quiet < 0.5 and loaded < 0.5, (quiet, loaded)        # starved, whether the machine is busy or not
    assert abs(loaded - quiet) < 0.15, (quiet, loaded)
