"""Chapter 08: profile every rank of a tensor-parallel LLM over the same window.

    ranks = profile_ranks(llm, llm.generate, prompts, params)   # one summary per rank, rank 0 first

Rank 0 runs `perf.profile` around the call; the workers start their own profiler when rank 0 tells
them and stop when it does, then send back the same analysis (`perf.Profile`: compute, comm, idle per
rank, and how much communication hid under compute). Only for workers this LLM started itself.
"""
from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass

import torch

from nanoserve.distributed.group import TensorParallelError, timeout_s
from nanoserve.distributed.worker import WorkerTask
from nanoserve.perf.profile import profile


@dataclass
class StartProfile(WorkerTask):
    """Rank 0 began its profile: the worker opens its own."""

    def run(self, worker) -> None:
        _rank_profiler.start()


@dataclass
class StopProfile(WorkerTask):
    """Rank 0's call ended: the worker closes its profile and sends back its summary."""

    def run(self, worker) -> dict:
        return _rank_profiler.stop(worker.rank)


def summarize(rank: int, prof) -> dict:
    """What a rank reports: its wall time split into categories, communication, and overlap."""
    return dict(rank=rank, wall_s=prof.wall_s, breakdown=prof.breakdown(), comm_s=prof.comm_s,
                busy_fraction=prof.busy_fraction, overlap_fraction=prof.overlap_fraction)


class RankProfiler:
    """A worker's side: a torch.profiler session opened by StartProfile and closed by StopProfile."""

    def __init__(self):
        self.session = None

    def start(self) -> None:
        from nanoserve.perf.trace import WINDOW_NAME
        self.tid = threading.get_native_id()
        self.session = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.session.__enter__()
        self.window = torch.profiler.record_function(WINDOW_NAME)
        self.window.__enter__()

    def stop(self, rank: int) -> dict:
        from nanoserve.perf.profile import Profile
        from nanoserve.perf.trace import events_from_torch
        self.window.__exit__(None, None, None)
        self.session.__exit__(None, None, None)
        events, window = events_from_torch(self.session, self.tid)
        self.session = None
        return summarize(rank, Profile(events, window, compute_lane=f"thread {self.tid}", device="cpu"))


_rank_profiler = RankProfiler()   # in a worker process, the one profiler its StartProfile and StopProfile share


def profile_ranks(llm, fn, *args, **kwargs) -> tuple[list[dict], object]:
    """Run `fn(*args, **kwargs)` on rank 0 while every rank profiles; ([summary per rank], fn's result)."""
    tp = getattr(llm, "tp", None)
    if tp is None:
        prof = profile(fn, *args, **kwargs)
        return [summarize(0, prof)], prof.result
    group = tp.group
    if group is None or not group.spawned:
        raise ValueError("profile_ranks needs the workers this LLM started itself (not a torchrun/accelerate launch)")
    stopped = False

    def call():   # the workers stop when the call ends, not after rank 0's analysis
        nonlocal stopped
        try:
            return fn(*args, **kwargs)
        finally:
            stopped = True
            group.send(StopProfile())

    group.send(StartProfile())
    try:
        prof = profile(call)
    finally:
        if not stopped:
            group.send(StopProfile())
    reports = [summarize(0, prof)]
    for rank, conn in enumerate(group.conns, start=1):
        deadline = time.monotonic() + timeout_s()
        while not conn.poll(0.1):
            if time.monotonic() > deadline:
                raise group.failure(TensorParallelError(f"worker rank {rank} sent no profile"))
        reports.append(pickle.loads(conn.recv_bytes()))
    return reports, prof.result
