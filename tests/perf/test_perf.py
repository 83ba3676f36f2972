"""Tests of nanoserve.perf: device choice, timing, peak memory, the hardware table and the roofline."""
import os
import sys
import time

import pytest
import torch

from nanoserve import perf
from nanoserve.perf import hardware, memory

MiB = 1 << 20


# --- device -----------------------------------------------------------------------------------------

def test_device_env_override(monkeypatch):
    monkeypatch.setenv("NANOSERVE_DEVICE", "cpu")
    assert perf.device() == torch.device("cpu")
    assert perf.device("auto") == torch.device("cpu")


def test_device_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv("NANOSERVE_DEVICE", "tpu")
    with pytest.raises(ValueError, match="tpu"):
        perf.device()
    with pytest.raises(ValueError, match="mps"):
        perf.device("mps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is missing")
def test_device_cuda_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setenv("NANOSERVE_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA"):
        perf.device()


# --- timing -----------------------------------------------------------------------------------------

def test_timeit_measures_a_sleep():
    calls = []

    def nap(s):
        calls.append(s)
        time.sleep(s)

    t = perf.timeit(nap, 0.02, warmup=2, repeat=7, device="cpu")
    assert len(calls) == 9  # warm-up runs happen but are not timed
    assert t.n == 7 and len(t.samples_s) == 7
    assert 0.02 <= t.min_s <= t.p10_s <= t.median_s <= t.p90_s <= t.max_s
    assert t.median_s < 0.2  # a sleep overshoots a little, not ten times
    assert "ms" in str(t) and "n=7" in str(t)


def test_timeit_passes_kwargs_and_checks_arguments():
    seen = {}
    perf.timeit(lambda a, b=0: seen.update(a=a, b=b), 1, b=2, warmup=0, repeat=1, device="cpu")
    assert seen == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="repeat"):
        perf.timeit(lambda: None, repeat=0)


def test_timing_statistics_are_exact_on_known_samples():
    t = perf.Timing(samples_s=(0.005, 0.001, 0.002, 0.004, 0.003), device="cpu")
    assert t.median_s == 0.003 and t.min_s == 0.001 and t.max_s == 0.005
    assert t.p10_s == pytest.approx(0.0014)
    assert t.p90_s == pytest.approx(0.0046)


@pytest.mark.parametrize("s, text", [(2.5, "2.5 s"), (1.234e-3, "1.23 ms"), (4.56e-6, "4.56 us"),
                                     (8.12e-7, "812 ns"), (0.25, "250 ms")])
def test_format_seconds(s, text):
    assert perf.format_seconds(s) == text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timeit_uses_cuda_events_on_gpu():
    dev = perf.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    t = perf.timeit(torch.matmul, a, a, warmup=2, repeat=5, device=dev)
    assert t.device.startswith("cuda")
    # 137 GFLOP: far more than 10 microseconds even on the fastest GPU, so the kernel itself was timed,
    # not just its asynchronous launch.
    assert t.min_s > 1e-5
    # A host-side timer without sync sees only the launch; the event timing must be much longer.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.matmul(a, a)
    launch_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert t.median_s > launch_s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_peak_bytes_on_gpu():
    dev = perf.device("cuda")
    pm = perf.peak_memory(lambda: torch.empty(64 * MiB, dtype=torch.uint8, device=dev), device=dev)
    assert pm.device_peak_bytes >= 64 * MiB


# --- memory -----------------------------------------------------------------------------------------

ALLOC_200MB = "import numpy as np; a = np.ones({n} // 8); assert a.sum() == {n} // 8"


def test_peak_rss_bytes_is_a_sane_high_water_mark():
    before = perf.peak_rss_bytes()
    assert 10 * MiB < before < 64 * 1024 * MiB
    pm = perf.peak_memory(lambda: torch.ones(300 * MiB // 4).sum())  # 300 MB, touched
    assert pm.rss_peak_after_bytes >= before
    assert pm.result.item() == 300 * MiB // 4
    assert pm.device_peak_bytes is None or torch.cuda.is_available()


def test_child_peak_rss_sees_a_200mb_allocation():
    small = perf.child_peak_rss([sys.executable, "-c", ALLOC_200MB.format(n=1 * MiB)])
    big = perf.child_peak_rss([sys.executable, "-c", ALLOC_200MB.format(n=200 * MiB)])
    assert big.returncode == 0
    # getrusage view: the big child peaks ~200 MB above the small one (not the parent's size)
    assert 180 * MiB < big.rusage_bytes - small.rusage_bytes < 260 * MiB
    if memory.has_time_v():
        assert 180 * MiB < big.time_v_bytes - small.time_v_bytes < 260 * MiB
        # both tools describe the same run
        assert abs(big.time_v_bytes - big.rusage_bytes) < 16 * MiB
    else:
        assert big.time_v_bytes is None


def test_child_peak_rss_is_not_inflated_by_a_big_parent():
    hog = torch.ones(400 * MiB // 4)  # make this process big; a naive spawn would inherit its peak
    small = perf.child_peak_rss([sys.executable, "-c", "pass"])
    assert small.rusage_bytes < 200 * MiB
    del hog


def test_child_peak_rss_without_gnu_time(monkeypatch):
    monkeypatch.setattr(memory, "TIME_BIN", "/nonexistent/time")
    r = perf.child_peak_rss([sys.executable, "-c", ALLOC_200MB.format(n=200 * MiB)])
    assert r.time_v_bytes is None
    assert r.rusage_bytes > 180 * MiB


def test_child_peak_rss_reports_failures():
    import subprocess
    with pytest.raises(subprocess.CalledProcessError):
        perf.child_peak_rss([sys.executable, "-c", "import sys; sys.exit(3)"])
    r = perf.child_peak_rss([sys.executable, "-c", "import sys; sys.exit(3)"], check=False)
    assert r.returncode == 3
    with pytest.raises(FileNotFoundError, match="no-such-command"):
        perf.child_peak_rss(["no-such-command-for-nanoserve"])


def test_parse_time_v():
    text = "\tCommand being timed: \"x\"\n\tMaximum resident set size (kbytes): 2048\n\tExit status: 0\n"
    assert memory._parse_time_v(text) == 2048 * 1024
    assert memory._parse_time_v("nothing here") is None


# --- hardware table ---------------------------------------------------------------------------------

REQUIRED = ["H100 SXM", "H200 SXM", "A100 80GB SXM", "L4", "RTX 4090", "MI300X", "DGX Spark"]


def test_hardware_table_has_the_course_machines():
    assert set(REQUIRED) <= set(perf.HARDWARE)


@pytest.mark.parametrize("name", REQUIRED)
def test_hardware_rows_are_sane(name):
    hw = perf.HARDWARE[name]
    assert hw.name == name and hw.source
    assert 1e12 < hw.fp32_flops < hw.bf16_flops < 5e15          # tensor units beat plain fp32
    assert 1e11 < hw.mem_bw < 1e13 and hw.mem_bw < hw.bf16_flops  # bytes/s far below FLOP/s
    assert 8e9 <= hw.mem_bytes <= 256e9
    assert 10 < hw.ridge_point("bf16") < 1000
    assert hw.ridge_point("fp32") < hw.ridge_point("bf16")
    with pytest.raises(ValueError, match="int3"):
        hw.peak_flops("int3")


def test_hardware_datasheet_spot_checks():
    h100, h200 = perf.HARDWARE["H100 SXM"], perf.HARDWARE["H200 SXM"]
    assert h100.bf16_flops == h200.bf16_flops          # same GH100 compute
    assert h200.mem_bw > h100.mem_bw and h200.mem_bytes > h100.mem_bytes
    assert h100.ridge_point() == pytest.approx(295, rel=0.01)


def test_measure_ceilings_measures_once_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hardware, "_MEASURED", {})
    calls = []
    real = hardware._matmul_flops
    monkeypatch.setattr(hardware, "_matmul_flops", lambda *a: calls.append(a) or real(*a))
    t0 = time.perf_counter()
    hw = perf.measure_ceilings(device="cpu")
    first_s = time.perf_counter() - t0
    assert hw.name == "this machine (cpu)"
    assert 1e8 < hw.fp32_flops < 1e15 and 1e8 < hw.mem_bw < 1e13
    assert 1e7 < hw.bf16_flops < 1e15 and hw.mem_bytes > 0   # whatever this CPU's bf16 kernels reach
    assert {a[1] for a in calls} == {torch.float32, torch.bfloat16}
    assert first_s < 30
    assert not any(tmp_path.rglob("*")), "ceilings must not be written to disk"

    n_calls = len(calls)
    again = perf.measure_ceilings(device="cpu")
    assert again is hw and len(calls) == n_calls  # served from this process's measurement
    perf.measure_ceilings(force=True, device="cpu")
    assert len(calls) > n_calls


def test_ceilings_are_never_read_from_an_earlier_run(tmp_path, monkeypatch):
    """A slow first measurement (another machine, a busy moment) lives only as long as its process: a new
    process (here: an emptied per-process table) measures again and gets today's numbers."""
    monkeypatch.setattr(hardware, "_MEASURED", {})
    flops, bw = iter([80e9, 80e9, 250e9, 250e9]), iter([9e9, 20e9])
    monkeypatch.setattr(hardware, "_matmul_flops", lambda *a: next(flops))
    monkeypatch.setattr(hardware, "_copy_bw", lambda *a: next(bw))
    assert (perf.measure_ceilings(device="cpu").fp32_flops, perf.measure_ceilings(device="cpu").mem_bw) == (80e9, 9e9)
    hardware._MEASURED.clear()   # what a new process starts with
    fresh = perf.measure_ceilings(device="cpu")
    assert (fresh.fp32_flops, fresh.mem_bw) == (250e9, 20e9)


def test_ceilings_are_per_thread_count(monkeypatch):
    monkeypatch.setattr(hardware, "_MEASURED", {})
    monkeypatch.setattr(hardware, "_matmul_flops", lambda n, dtype, dev: 1e11 * torch.get_num_threads())
    monkeypatch.setattr(hardware, "_copy_bw", lambda *a: 1e10)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = perf.measure_ceilings(device="cpu")
        torch.set_num_threads(2)
        two = perf.measure_ceilings(device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert (one.fp32_flops, two.fp32_flops) == (1e11, 2e11)


def test_kernel_ceiling_reports_the_rates_of_its_best_call():
    a = torch.randn(256, 256)
    roof = perf.kernel_ceiling(lambda: a @ a, flops=2 * 256**3, nbytes=3 * a.nbytes, repeat=3)
    assert roof.seconds > 0
    assert roof.flops_per_s == pytest.approx(2 * 256**3 / roof.seconds)
    assert roof.bytes_per_s == pytest.approx(3 * a.nbytes / roof.seconds)
    assert roof.time_for(4 * 256**3) == pytest.approx(2 * roof.seconds)
    with pytest.raises(ValueError, match="flops or nbytes"):
        perf.kernel_ceiling(lambda: None, flops=0, nbytes=0)


def test_the_bandwidth_ceiling_copies_more_than_any_cache(monkeypatch):
    """The CPU copy touches source + destination: at least twice the last-level cache a machine reports."""
    monkeypatch.setattr(hardware, "_MEASURED", {})
    sizes = []
    monkeypatch.setattr(hardware, "_matmul_flops", lambda *a: 1e11)
    monkeypatch.setattr(hardware, "_copy_bw", lambda nbytes, dev: sizes.append(nbytes) or 1e10)
    perf.measure_ceilings(device="cpu")
    try:
        l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        l3 = 0
    assert sizes == [hardware.CPU_COPY_BYTES]
    assert 2 * sizes[0] >= max(2 * (l3 or 0), 1 << 30)


# --- roofline ---------------------------------------------------------------------------------------

TOY = perf.Hardware("toy", bf16_flops=100e12, fp32_flops=10e12, mem_bw=1e12, mem_bytes=16e9,
                    interconnect="none", interconnect_bw=None, source="made up for tests")


def test_roofline_memory_bound_matvec():
    n = 4096  # bf16 matrix-vector product: 2n^2 FLOPs, n^2 * 2 bytes of matrix dominate
    flops, nbytes = 2 * n * n, 2 * (n * n + 2 * n)
    r = perf.roofline(flops, nbytes, TOY, dtype="bf16")
    assert r.bound == "memory"
    assert r.arithmetic_intensity == pytest.approx(flops / nbytes)
    assert r.ridge_point == 100
    assert r.predicted_s == pytest.approx(nbytes / 1e12)
    assert r.compute_s == pytest.approx(flops / 100e12)


def test_roofline_compute_bound_matmul():
    n = 4096  # bf16 square matmul: 2n^3 FLOPs over 3 * n^2 * 2 bytes -> intensity n/3 ~ 1365
    r = perf.roofline(2 * n**3, 6 * n * n, TOY, dtype="bf16")
    assert r.bound == "compute"
    assert r.arithmetic_intensity == pytest.approx(n / 3)
    assert r.predicted_s == pytest.approx(2 * n**3 / 100e12)


def test_roofline_bound_flips_at_the_ridge():
    below = perf.roofline(99e9, 1e9, TOY)
    at = perf.roofline(100e9, 1e9, TOY)
    above = perf.roofline(101e9, 1e9, TOY)
    assert (below.bound, at.bound, above.bound) == ("memory", "compute", "compute")
    assert at.compute_s == pytest.approx(at.memory_s) == pytest.approx(at.predicted_s)
    # the fp32 ridge of the same machine is 10x lower, so the same work is compute bound there
    assert perf.roofline(50e9, 1e9, TOY, dtype="fp32").bound == "compute"
    assert perf.roofline(50e9, 1e9, TOY, dtype="bf16").bound == "memory"


def test_roofline_rejects_nonsense():
    with pytest.raises(ValueError, match="bytes"):
        perf.roofline(1.0, 0, TOY)
    no_bf16 = perf.Hardware("cpu", None, 1e9, 1e9, 1e9, "", None, "")
    with pytest.raises(ValueError, match="bf16"):
        perf.roofline(1.0, 1.0, no_bf16, dtype="bf16")
    assert perf.roofline(0.5, 1.0, no_bf16, dtype="fp32").bound == "memory"


def test_plot_roofline_draws_roof_and_points():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = perf.plot_roofline(TOY, [("matvec", 2e6, 2e6, 1e-5), ("matmul", 2e9, 6e6, 1e-3)])
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "FLOP / byte" in ax.get_xlabel() and "FLOP / s" in ax.get_ylabel()
    texts = [t.get_text() for t in ax.texts]
    assert "matvec" in texts and "matmul" in texts
    roof = ax.lines[0].get_ydata()
    assert max(roof) == pytest.approx(100e12)
    plt.close(ax.figure)


# --- notebook helper --------------------------------------------------------------------------------

def test_show_prints_source_with_relative_path(capsys):
    from nanoserve.course.notebook import show, source
    path, text = source(perf.timeit)
    assert path == "nanoserve/perf/timing.py" and text.startswith("def timeit(")
    show(perf.roofline)
    out = capsys.readouterr().out
    assert "```python\ndef roofline(" in out and "nanoserve/perf/roofline.py" in out
    assert "/work/" not in out
    with pytest.raises(TypeError, match="show"):
        show(42)


def test_keep_freed_memory_sets_glibc_or_says_it_cannot():
    import platform

    kept = perf.keep_freed_memory()
    assert isinstance(kept, bool)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert kept
    big = torch.ones(4 << 20)          # still allocates and frees as before
    assert big.sum().item() == 4 << 20


def test_keep_freed_memory_every_size_reuses_big_tensors_without_page_faults():
    # in a child process: the setting is process-wide and keeps freed memory until exit
    import platform
    import subprocess
    import sys

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    code = (
        "import resource, torch\n"
        "from nanoserve import perf\n"
        "assert perf.keep_freed_memory(every_size=True)\n"
        "def faults(n):\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    torch.ones(n)\n"                 # 256 MB, allocated, written and freed
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "n = 64 << 20\n"
        "first, later = faults(n), [faults(n) for _ in range(8)]\n"
        "print(first, later)\n"
        # 65536 4-KiB pages the first time. mmap'd (the default above 32 MB) every call faults them all again;
        # kept, most calls reuse the freed block (a small allocation landing in it can cost one more fault-in)
        "assert first > 10_000 and sum(later) < 3 * first, (first, later)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dispatch_cost_is_microseconds_per_tiny_op():
    from nanoserve import perf
    cost = perf.dispatch_cost("cpu", ops=100, repeat=5)
    assert 1e-7 < cost < 1e-3      # a 1-element add: host work only, far from a millisecond


def test_count_ops_counts_top_level_operators_once():
    from nanoserve import perf
    lin = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    counts = perf.count_ops(lambda: torch.relu(lin(x)) + 1)
    assert counts["aten::linear"] == 1 and counts["aten::relu"] == 1 and counts["aten::add"] == 1
    assert "aten::addmm" not in counts and "aten::t" not in counts      # called inside aten::linear
