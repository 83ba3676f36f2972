"""Collectives and their cost: run_group (spawned ranks, bounded), the ring alpha-beta model, nccl-tests'
bus bandwidth, the alpha-beta fit, and a real 2-rank gloo sweep.

The functions the ranks run are defined here, at module level: spawn re-imports them by name (the
child gets the parent's sys.path, where pytest put this directory).
"""
import math
import multiprocessing
import os
import time

import pytest
import torch

from nanoserve import perf
from nanoserve.distributed.launch import free_port, run_group
from nanoserve.perf import comm

# --- what the ranks run -------------------------------------------------------------------------


def rank_info(rank, world_size, tag):
    import torch.distributed as dist
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return {"rank": rank, "world": dist.get_world_size(), "sum": x.item(), "tag": tag,
            "threads": torch.get_num_threads(), "pid": os.getpid()}


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from the test")
    import torch.distributed as dist
    dist.barrier()          # rank 0 would wait here for the rank that died: the parent must not
    return rank


def exit_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    import torch.distributed as dist
    dist.barrier()
    return rank


def sleep_forever(rank, world_size):
    time.sleep(3600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --- run_group --------------------------------------------------------------------------------------


def test_free_port_is_bindable():
    import socket
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_run_group_returns_each_ranks_value_in_rank_order():
    out = run_group(rank_info, 2, "hello", timeout_s=30)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["sum"] == 3.0 and o["tag"] == "hello" for o in out)
    assert all(o["threads"] == 1 for o in out)                     # one thread per rank by default
    assert out[0]["pid"] != out[1]["pid"] != os.getpid()
    assert not any(_alive(o["pid"]) for o in out) and _ranks_left() == []


def _ranks_left():
    return [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-rank")]


def test_failing_rank_raises_naming_it_fast_and_leaves_no_process():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed: ValueError: boom from the test"):
        run_group(fail_on_rank_one, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30             # not the 60 s collective timeout: rank 0 is terminated
    assert _ranks_left() == []


def test_dead_rank_reports_its_exit_code():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 died with exit code 3"):
        run_group(exit_on_rank_one, 2, timeout_s=60)
    assert _ranks_left() == []


def test_deadline_bounds_a_rank_that_never_returns():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"deadline of 2 s passed; ranks \[0\] of 1"):
        run_group(sleep_forever, 1, timeout_s=30, deadline_s=2)
    assert time.monotonic() - t0 < 20
    assert _ranks_left() == []


def test_run_group_rejects_zero_ranks():
    with pytest.raises(ValueError):
        run_group(rank_info, 0, "x")


# --- the ring model and bus bandwidth ----------------------------------------------------------------


def test_ring_model_against_hand_values():
    # n = 4, alpha = 10 us, beta = 1 GB/s, S = 8 MB: all-reduce 2*3*10 us + 2*3/4 * 8e6 / 1e9 = 60 us + 12 ms
    assert perf.ring_allreduce_time(8e6, 4, 10e-6, 1e9) == pytest.approx(60e-6 + 12e-3)
    assert perf.ring_allgather_time(8e6, 4, 10e-6, 1e9) == pytest.approx(30e-6 + 6e-3)
    assert perf.ring_reduce_scatter_time(8e6, 4, 10e-6, 1e9) == pytest.approx(30e-6 + 6e-3)
    # n = 2: all-reduce moves S/2 twice; one rank moves nothing
    assert perf.ring_allreduce_time(1e6, 2, 0.0, 1e9) == pytest.approx(1e-3)
    assert perf.ring_allreduce_time(1e6, 1, 1e-5, 1e9) == 0.0
    # all-reduce = reduce-scatter + all-gather
    for n in (2, 3, 8):
        assert perf.ring_allreduce_time(5e6, n, 3e-6, 2e9) == pytest.approx(
            perf.ring_reduce_scatter_time(5e6, n, 3e-6, 2e9) + perf.ring_allgather_time(5e6, n, 3e-6, 2e9))
    with pytest.raises(ValueError, match="broadcast"):
        perf.collective_time("broadcast", 1, 2, 1, 1)


def test_bus_bandwidth_is_nccl_tests_definition():
    # 1 GB in 10 ms: algbw 100 GB/s; busbw x 2(n-1)/n for all-reduce, (n-1)/n for the others
    assert perf.bus_bandwidth(1e9, 0.01, 8, "all_reduce") == pytest.approx(100e9 * 14 / 8)
    assert perf.bus_bandwidth(1e9, 0.01, 8, "all_gather") == pytest.approx(100e9 * 7 / 8)
    assert perf.bus_bandwidth(1e9, 0.01, 8, "reduce_scatter") == pytest.approx(100e9 * 7 / 8)
    assert perf.bus_bandwidth(1e9, 0.01, 2) == pytest.approx(100e9)
    # with no latency, busbw of the ring model is beta for every n and op
    for n in (2, 4, 8):
        for op in comm.OPS:
            t = perf.collective_time(op, 64e6, n, 0.0, 37e9)
            assert perf.bus_bandwidth(64e6, t, n, op) == pytest.approx(37e9)


def test_interconnect_rows_predict_through_the_ring_model():
    nv = perf.INTERCONNECTS["NVLink 4 (H100/H200 SXM)"]
    assert nv.bw == 450e9 and nv.source and nv.latency_s > 0        # 900 GB/s is both directions
    assert nv.collective_time("all_reduce", 16e6, 8) == pytest.approx(14 * nv.latency_s + 14 / 8 * 16e6 / 450e9)
    bws = [perf.INTERCONNECTS[k].bw for k in ("NVLink 4 (H100/H200 SXM)", "PCIe Gen5 x16", "InfiniBand NDR 400 Gb/s",
                                             "PCIe Gen4 x16")]
    assert bws == sorted(bws, reverse=True)
    assert all(i.source and 0 < i.latency_s < 1e-4 for i in perf.INTERCONNECTS.values())
    assert perf.HARDWARE["H100 SXM"].interconnect_latency_s == nv.latency_s


# --- the fit ---------------------------------------------------------------------------------------------

SIZES = [4 << 10 << k for k in range(0, 15, 2)]   # 4 KiB .. 64 MiB


@pytest.mark.parametrize("op,n", [("all_reduce", 2), ("all_reduce", 4), ("all_gather", 8), ("reduce_scatter", 3)])
def test_fit_recovers_alpha_beta_from_synthetic_data(op, n):
    alpha, beta = 25e-6, 3e9
    exact = [perf.collective_time(op, s, n, alpha, beta) for s in SIZES]
    fit = perf.fit_alpha_beta(SIZES, exact, n, op)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6) and fit.beta_Bps == pytest.approx(beta, rel=1e-6)
    assert fit.max_relative_error(SIZES, exact, n, op) < 1e-6
    # +-10% multiplicative noise: both still recovered within 15%
    g = torch.Generator().manual_seed(0)
    noisy = [t * (1 + 0.1 * (2 * torch.rand(1, generator=g).item() - 1)) for t in exact]
    alpha_f, beta_f = perf.fit_alpha_beta(SIZES, noisy, n, op)
    assert alpha_f == pytest.approx(alpha, rel=0.15) and beta_f == pytest.approx(beta, rel=0.15)


def test_fit_keeps_parameters_non_negative():
    # times that fall with size cannot be fitted by a positive beta: beta is inf, alpha what fits
    fit = perf.fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3], 2)
    assert fit.alpha_s > 0 and math.isinf(fit.beta_Bps)
    # pure bandwidth: alpha 0
    fit = perf.fit_alpha_beta([1e6, 4e6], [1e-3, 4e-3], 2)
    assert fit.alpha_s == pytest.approx(0, abs=1e-12) and fit.beta_Bps == pytest.approx(1e9)
    with pytest.raises(ValueError):
        perf.fit_alpha_beta([1e6], [1e-3], 2)


# --- a real sweep ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep():
    return perf.measure_collective([4 << 10, 1 << 20, 8 << 20], world_size=2, repeats=5, warmup=2, timeout_s=30)


def test_measure_collective_gloo_two_ranks(sweep):
    assert sweep.sizes_bytes == (4 << 10, 1 << 20, 8 << 20) and sweep.world_size == 2
    assert all(len(x) == 5 for x in sweep.samples_s)
    t = sweep.quantile(0)                            # each size's fastest call: one stalled call (a scheduler
    assert max(t[0], t[1]) < t[2]                    # tick on a busy 2-core machine) cannot reorder them; 8 and
                                                     # 2048x fewer bytes take less time (4 KB against 1 MB, about
                                                     # a millisecond each on gloo, is within a stall: not compared)
    for row in sweep.rows():
        assert row["algbw_Bps"] == pytest.approx(row["size_bytes"] / row["median_s"])
        assert row["busbw_Bps"] == pytest.approx(row["algbw_Bps"])        # n = 2: 2(n-1)/n = 1
    assert sweep.quantile(0.5) == pytest.approx(sweep.seconds) and t == tuple(min(x) for x in sweep.samples_s)
    fit = sweep.fit()
    assert fit.alpha_s >= 0 and fit.beta_Bps > 0
    text = sweep.table(fit)
    assert "all_reduce over 2 ranks (gloo, float32)" in text and "GB/s" in text and "8 MiB" in text


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_measure_other_collectives(op):
    # 4 KiB against 16 MiB: the ring model puts them an order of magnitude apart (alpha against megabytes over
    # beta), far above a stalled call on a busy machine; each size's fastest call is compared, not its median
    s = perf.measure_collective([4 << 10, 16 << 20], world_size=2, op=op, repeats=3, warmup=1, timeout_s=30)
    fastest = s.quantile(0)
    assert s.op == op and fastest[0] < fastest[1]
    assert s.busbw[1] == pytest.approx(s.algbw[1] / 2)                       # n = 2: (n-1)/n = 1/2


def test_measure_collective_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple"):
        perf.measure_collective([6], world_size=2)
    with pytest.raises(ValueError, match="op"):
        perf.measure_collective([4096], op="all_to_all")


def test_plot_collective(sweep):
    import matplotlib
    matplotlib.use("Agg")
    nv = perf.INTERCONNECTS["NVLink 4 (H100/H200 SXM)"]
    ax = perf.plot_collective(sweep, sweep.fit(), models={"NVLink 4": perf.AlphaBeta(nv.latency_s, nv.bw)})
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "bytes" in ax.get_xlabel() and "(s)" in ax.get_ylabel()
    assert len(ax.get_lines()) >= 2
