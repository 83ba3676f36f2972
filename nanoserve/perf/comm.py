"""What a collective costs: the ring's alpha-beta model, bus bandwidth, and a measured message-size sweep.

The model (Hockney's alpha-beta, applied to the ring algorithm; Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH"). n ranks sit on a ring; a message of S
bytes is cut into n chunks of S/n. Each step, every rank sends one chunk to its right neighbour and
receives one from its left, and a step costs alpha (the fixed latency of one send: software, the
link, the synchronisation) plus (S/n)/beta (the bytes over a link of beta bytes/s, each direction).

- reduce-scatter: n-1 steps, after which rank i holds the sum of chunk i  ->  (n-1)*alpha + (n-1)/n * S/beta
- all-gather:     n-1 steps, each rank passes on the chunk it got          ->  (n-1)*alpha + (n-1)/n * S/beta
- all-reduce = reduce-scatter then all-gather                             ->  2(n-1)*alpha + 2(n-1)/n * S/beta

S is the size nccl-tests calls the message size: the buffer being all-reduced; the full (gathered)
output of an all-gather; the full input of a reduce-scatter. nccl-tests (NVIDIA/nccl-tests,
doc/PERFORMANCE.md) reports two bandwidths: the algorithm bandwidth algbw = S / t, and the bus
bandwidth busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for all-gather and reduce-scatter.
The factor is exactly the one in the model's bandwidth term, so for large messages busbw -> beta,
whatever n is: busbw is the number to compare with a link's per-direction bandwidth.

`measure_collective` times a real collective over torch.distributed (gloo between CPU processes here,
NCCL between GPUs) over a sweep of sizes, and `fit_alpha_beta` fits alpha and beta to what it measured.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op {op!r} is not known: expected one of {', '.join(OPS)}")


def _coefficients(op: str, world_size: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of the ring: time = steps * alpha + factor * S / beta."""
    _check_op(op)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    return float(n - 1), (n - 1) / n


def collective_time(op: str, nbytes: float, world_size: int, alpha_s: float, beta_Bps: float) -> float:
    """Seconds the ring algorithm takes for `op` on a message of `nbytes` over `world_size` ranks.

    alpha_s: the latency of one ring step, seconds; beta_Bps: one link's bandwidth, bytes/s each direction.
    One rank moves nothing: 0 s.
    """
    steps, factor = _coefficients(op, world_size)
    return steps * alpha_s + factor * nbytes / beta_Bps


def ring_allreduce_time(nbytes: float, world_size: int, alpha_s: float, beta_Bps: float) -> float:
    """2(n-1)*alpha + 2(n-1)/n * S/beta: a reduce-scatter then an all-gather, n-1 ring steps each.

    Each rank sends (and receives) 2(n-1) chunks of S/n bytes; 2(n-1)/n is the factor by which
    nccl-tests turns algorithm bandwidth S/t into bus bandwidth, so busbw -> beta for large S.
    """
    return collective_time("all_reduce", nbytes, world_size, alpha_s, beta_Bps)


def ring_allgather_time(nbytes: float, world_size: int, alpha_s: float, beta_Bps: float) -> float:
    """(n-1)*alpha + (n-1)/n * S/beta, S the gathered output (each rank contributes S/n)."""
    return collective_time("all_gather", nbytes, world_size, alpha_s, beta_Bps)


def ring_reduce_scatter_time(nbytes: float, world_size: int, alpha_s: float, beta_Bps: float) -> float:
    """(n-1)*alpha + (n-1)/n * S/beta, S the full input (each rank keeps S/n of the sum)."""
    return collective_time("reduce_scatter", nbytes, world_size, alpha_s, beta_Bps)


def bus_bandwidth(nbytes: float, seconds: float, world_size: int, op: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth, bytes/s: algbw = S/t times 2(n-1)/n (all-reduce) or (n-1)/n (the others).

    It is the rate at which each rank's link carries bytes, comparable across n and with the hardware's
    per-direction bandwidth (which it approaches for large messages, in the ring model).
    """
    _, factor = _coefficients(op, world_size)
    return nbytes / seconds * factor


class AlphaBeta(NamedTuple):
    """A fitted (or datasheet) ring cost model: alpha_s seconds per step, beta_Bps bytes/s per link direction."""

    alpha_s: float
    beta_Bps: float

    def time(self, nbytes: float, world_size: int, op: str = "all_reduce") -> float:
        return collective_time(op, nbytes, world_size, self.alpha_s, self.beta_Bps)

    def relative_errors(self, sizes_bytes: Sequence[float], seconds: Sequence[float], world_size: int,
                        op: str = "all_reduce") -> list[float]:
        """(model - measured) / measured for each size."""
        return [(self.time(s, world_size, op) - t) / t for s, t in zip(sizes_bytes, seconds)]

    def max_relative_error(self, sizes_bytes, seconds, world_size: int, op: str = "all_reduce") -> float:
        return max(abs(e) for e in self.relative_errors(sizes_bytes, seconds, world_size, op))


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], world_size: int,
                   op: str = "all_reduce") -> AlphaBeta:
    """Least-squares fit of the ring model to measured times; returns (alpha_s, beta_Bps).

    The model is linear in alpha and 1/beta. The fit minimises the *relative* residuals
    ((model - measured) / measured), as one reads a log-log plot: a plain least squares in seconds is
    decided by the largest messages alone and leaves alpha to chance. Both parameters are kept
    non-negative (a negative latency is not a cost); if times do not grow with size at all, beta is inf.
    """
    import numpy as np
    if len(sizes_bytes) != len(seconds) or len(seconds) < 2:
        raise ValueError("need at least two (size, seconds) pairs of equal length")
    steps, factor = _coefficients(op, world_size)
    if steps == 0:
        raise ValueError("one rank communicates nothing: there is no alpha or beta to fit")
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if np.any(t <= 0):
        raise ValueError("every measured time must be > 0")
    a = np.stack([steps / t, factor * s / t], axis=1)      # [alpha, 1/beta] . row = 1 for a perfect fit
    one = np.ones_like(t)

    def residual(x):
        return float(np.sum((a @ x - one) ** 2))

    candidates = []
    x, *_ = np.linalg.lstsq(a, one, rcond=None)
    if np.all(x >= 0):
        candidates.append(x)
    for keep in (0, 1):                                    # one parameter at zero, the other fitted
        col = a[:, keep]
        v = max(0.0, float(col @ one / (col @ col)))
        candidates.append(np.array([v, 0.0]) if keep == 0 else np.array([0.0, v]))
    best = min(candidates, key=residual)
    alpha, inv_beta = float(best[0]), float(best[1])
    return AlphaBeta(alpha, math.inf if inv_beta == 0 else 1.0 / inv_beta)


@dataclass(frozen=True)
class CollectiveSweep:
    """A measured message-size sweep of one collective: per size, the median seconds and the bandwidths.

    samples_s[i] holds, for size i, one time per timed call: the slowest rank's (a collective is done
    when its last rank is).
    """

    op: str
    world_size: int
    backend: str
    dtype: str
    sizes_bytes: tuple[int, ...]
    samples_s: tuple[tuple[float, ...], ...]

    @property
    def seconds(self) -> tuple[float, ...]:
        """Median seconds per size."""
        return tuple(statistics.median(xs) for xs in self.samples_s)

    @property
    def algbw(self) -> tuple[float, ...]:
        """Algorithm bandwidth S/t per size, bytes/s."""
        return tuple(s / t for s, t in zip(self.sizes_bytes, self.seconds))

    @property
    def busbw(self) -> tuple[float, ...]:
        """nccl-tests' bus bandwidth per size, bytes/s."""
        return tuple(bus_bandwidth(s, t, self.world_size, self.op) for s, t in zip(self.sizes_bytes, self.seconds))

    def quantile(self, q: float) -> tuple[float, ...]:
        """Seconds per size at quantile q of the timed calls (0.5 is the median, 0 the fastest call)."""
        from nanoserve.perf.timing import _quantile
        return tuple(_quantile(sorted(xs), q) for xs in self.samples_s)

    def fit(self, q: float = 0.5) -> AlphaBeta:
        """The ring model fitted to the median times (or to quantile q of each size's calls).

        On a shared 2-core machine a call is sometimes stalled for a scheduler tick (a few ms, both ranks
        at once); where such calls are near half of a size's samples its median jumps. A lower quantile
        (q = 0.25) fits the unstalled calls and is steadier; say which one a claim uses.
        """
        return fit_alpha_beta(self.sizes_bytes, self.quantile(q), self.world_size, self.op)

    def rows(self) -> list[dict]:
        return [{"size_bytes": s, "median_s": t, "algbw_Bps": a, "busbw_Bps": b}
                for s, t, a, b in zip(self.sizes_bytes, self.seconds, self.algbw, self.busbw)]

    def table(self, fit: AlphaBeta | None = None) -> str:
        """The sweep as text; with `fit`, the model's time and its error per size too."""
        from nanoserve.perf.timing import format_seconds
        head = f"{'size':>9}  {'median':>9}  {'algbw':>11}  {'busbw':>11}"
        if fit is not None:
            head += f"  {'model':>9}  {'error':>7}"
        lines = [f"{self.op} over {self.world_size} ranks ({self.backend}, {self.dtype})", head]
        for s, t, a, b in zip(self.sizes_bytes, self.seconds, self.algbw, self.busbw):
            line = f"{_format_bytes(s):>9}  {format_seconds(t):>9}  {a / 1e9:7.3g} GB/s  {b / 1e9:7.3g} GB/s"
            if fit is not None:
                m = fit.time(s, self.world_size, self.op)
                line += f"  {format_seconds(m):>9}  {100 * (m - t) / t:+6.0f}%"
            lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _reduce_scatter(out, inp):
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # renamed in torch 2.13
    return fn(out, inp)


def _sweep_rank(rank: int, world_size: int, sizes_bytes, op: str, repeats: int, warmup: int,
                dtype: torch.dtype, device_type: str) -> list[list[float]]:
    """One rank of measure_collective: per size, the seconds of each timed call (this rank's clock)."""
    import torch.distributed as dist
    dev = torch.device(device_type)
    if dev.type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    n = world_size
    item = torch.empty((), dtype=dtype).element_size()
    bufs = []
    for size in sizes_bytes:
        numel = size // item
        if op == "all_reduce":
            bufs.append((torch.full((numel,), float(rank + 1), dtype=dtype, device=dev),))
        elif op == "all_gather":
            bufs.append((torch.empty(numel, dtype=dtype, device=dev),
                         torch.full((numel // n,), float(rank + 1), dtype=dtype, device=dev)))
        else:
            bufs.append((torch.empty(numel // n, dtype=dtype, device=dev),
                         torch.full((numel,), float(rank + 1), dtype=dtype, device=dev)))

    def call(b):
        if op == "all_reduce":
            dist.all_reduce(b[0])
        elif op == "all_gather":
            dist.all_gather_into_tensor(b[0], b[1])
        else:
            _reduce_scatter(b[0], b[1])

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    total = n * (n + 1) / 2
    for b in bufs:                       # first warm-up call checks the collective computed the right thing
        call(b)
        sync()
        if op == "all_gather":
            expect = torch.arange(1, n + 1, dtype=dtype, device=dev).repeat_interleave(b[1].numel())
            ok = torch.equal(b[0], expect)
        else:
            ok = bool((b[0] == total).all())
        if not ok:
            raise RuntimeError(f"{op} over {n} ranks returned a wrong result for {b[0].numel() * item} bytes")
        for x in b:
            x.zero_()                    # zeros stay zeros: repeated all-reduces neither overflow nor go subnormal
        for _ in range(warmup - 1):
            call(b)
    sync()
    times: list[list[float]] = [[] for _ in sizes_bytes]
    order = list(range(len(bufs)))
    for r in range(repeats):             # sizes interleaved within each round: drift hits every size alike;
        random.Random(r).shuffle(order)  # a new order each round (the same on every rank, seeded by the round):
        for i in order:                  # no size always follows the 64 MiB one
            b = bufs[i]
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            call(b)
            sync()
            times[i].append(time.perf_counter() - t0)
    return times


def measure_collective(sizes_bytes: Sequence[int], world_size: int = 2, op: str = "all_reduce",
                       backend: str = "gloo", repeats: int = 15, warmup: int = 3,
                       dtype: torch.dtype = torch.float32, timeout_s: float = 60.0) -> CollectiveSweep:
    """Time `op` over `world_size` spawned ranks for each message size; the median of `repeats` calls per size.

    Sizes are nccl-tests' message sizes in bytes (see the module docstring) and must be a multiple of
    world_size x the dtype's size. Each size first runs `warmup` untimed calls (the first checks the
    result), then the timed calls, sizes interleaved round by round in a shuffled order, each after a barrier; a call's time
    is the slowest rank's. backend "gloo" runs on CPU processes (one thread each), "nccl" one GPU per rank.
    gloo has no bf16 all-reduce: use float32 there.
    """
    from nanoserve.distributed.launch import run_group
    _check_op(op)
    if repeats < 1 or warmup < 1:
        raise ValueError("repeats and warmup must be >= 1")
    item = torch.empty((), dtype=dtype).element_size()
    sizes = tuple(int(s) for s in sizes_bytes)
    for s in sizes:
        if s <= 0 or s % (item * world_size):
            raise ValueError(f"message size {s} bytes is not a positive multiple of world_size x {item} bytes")
    device_type = "cuda" if backend == "nccl" else "cpu"
    per_rank = run_group(_sweep_rank, world_size, sizes, op, repeats, warmup, dtype, device_type,
                         backend=backend, timeout_s=timeout_s)
    samples = tuple(tuple(max(rank_times[i][k] for rank_times in per_rank) for k in range(repeats))
                    for i in range(len(sizes)))
    return CollectiveSweep(op, world_size, backend, str(dtype).replace("torch.", ""), sizes, samples)


def plot_collective(sweep: CollectiveSweep, fit: AlphaBeta | None = None, models: dict | None = None, ax=None):
    """Log-log plot of a sweep: measured medians (with their p10-p90 spread), the fitted model, other models.

    models: {label: AlphaBeta} drawn as dashed lines over the same sizes (e.g. datasheet interconnects).
    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    s = np.asarray(sweep.sizes_bytes, dtype=float)
    med = np.asarray(sweep.seconds)
    lo = np.asarray([np.percentile(x, 10) for x in sweep.samples_s])
    hi = np.asarray([np.percentile(x, 90) for x in sweep.samples_s])
    ax.errorbar(s, med, yerr=[med - lo, hi - med], fmt="o", ms=4, capsize=2,
                label=f"measured ({sweep.backend}, {sweep.world_size} ranks, median)")
    grid = np.geomspace(s.min(), s.max(), 100)
    if fit is not None:
        ax.plot(grid, [fit.time(x, sweep.world_size, sweep.op) for x in grid], "-",
                label=f"fit: α = {fit.alpha_s * 1e6:.3g} µs, β = {fit.beta_Bps / 1e9:.3g} GB/s")
    for label, model in (models or {}).items():
        ax.plot(grid, [model.time(x, sweep.world_size, sweep.op) for x in grid], "--", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel(f"{sweep.op} time (s)")
    ax.set_title(f"{sweep.op} over {sweep.world_size} ranks: time vs message size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


__all__ = ["AlphaBeta", "CollectiveSweep", "OPS", "bus_bandwidth", "collective_time", "fit_alpha_beta",
           "measure_collective", "plot_collective", "ring_allgather_time", "ring_allreduce_time",
           "ring_reduce_scatter_time"]
