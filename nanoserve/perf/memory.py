"""Peak memory, three ways, because each tool sees a different number.

- `peak_rss_bytes()`: this process's resident-set high-water mark (getrusage, RUSAGE_SELF). It never
  goes down, so it only shows a new allocation if that allocation pushes past every earlier peak.
- `child_peak_rss(cmd)`: a fresh child process's peak RSS, as `/usr/bin/time -v` reports it
  ("Maximum resident set size") and as getrusage reports it for that one child.
  A fresh process has no earlier peak to hide behind, so this is the clean measurement.
- `device_peak_bytes()`: bytes the CUDA caching allocator handed out at its peak
  (torch.cuda.max_memory_allocated). It counts tensors only: not the CUDA context, not cached-but-free
  blocks, not other processes. None on a machine without CUDA.
- `keep_freed_memory()`: make the C allocator keep freed memory, as a caching allocator does, so that
  timings of steps with big temporaries are not timings of page faults.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nanoserve.device import device as _device, sync

TIME_BIN = "/usr/bin/time"  # GNU time; `time` in a shell is a builtin without -v


def _maxrss_to_bytes(ru_maxrss: int) -> int:
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return ru_maxrss if sys.platform == "darwin" else ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (a high-water mark: it never decreases)."""
    import resource
    return _maxrss_to_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def process_peak_rss_bytes(pid: int) -> int | None:
    """Another process's peak resident set size so far (Linux's VmHWM), in bytes; None where /proc has none."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class ChildPeak:
    """What the operating system saw of one child process's memory, in bytes."""

    cmd: tuple[str, ...]
    returncode: int
    time_v_bytes: int | None  # "Maximum resident set size" from /usr/bin/time -v; None without GNU time
    rusage_bytes: int         # the child's ru_maxrss from getrusage (os.wait4), as bytes
    stdout: str
    stderr: str


# A tiny launcher between us and the command. Linux credits a new process with the peak RSS of the
# address space it exec'd from, so a child spawned straight from a 1 GB notebook kernel "peaks" at
# 1 GB whatever it does. Spawned from this ~10 MB interpreter instead, its ru_maxrss is its own.
_LAUNCHER = """
import os, sys
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {code}")
sys.exit(code if code >= 0 else 128 - code)
"""


def child_peak_rss(cmd: list[str], check: bool = True, timeout_s: float | None = 300) -> ChildPeak:
    """Run `cmd` in a fresh child process; report its peak RSS as /usr/bin/time -v and getrusage see it.

    The command runs under `/usr/bin/time -v` when GNU time is installed (else `time_v_bytes` is None),
    inside a small launcher that reads the child's rusage with os.wait4. That is the per-child number
    that getrusage(RUSAGE_CHILDREN) aggregates; RUSAGE_CHILDREN itself is a high-water mark over every
    child ever reaped, so an earlier, bigger child would hide this one.
    """
    cmd = [str(c) for c in cmd]
    if not cmd or shutil.which(cmd[0]) is None:
        raise FileNotFoundError(f"child_peak_rss: command {cmd[:1]!r} not found (expected an executable on PATH)")
    use_time = has_time_v()
    with tempfile.TemporaryDirectory(prefix="nanoserve-mem-") as tmp:
        report, usage_file = os.path.join(tmp, "time-v.txt"), os.path.join(tmp, "rusage.txt")
        inner = [TIME_BIN, "-v", "-o", report, *cmd] if use_time else cmd
        argv = [sys.executable, "-I", "-S", "-c", _LAUNCHER, usage_file, *inner]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        if not os.path.exists(usage_file):  # the launcher itself failed, e.g. the command does not exist
            raise RuntimeError(f"could not run {cmd!r}: {proc.stderr.strip()}")
        maxrss, returncode = (int(x) for x in open(usage_file).read().split())
        time_v = _parse_time_v(open(report).read()) if use_time and os.path.exists(report) else None
    if check and returncode != 0:
        raise subprocess.CalledProcessError(returncode, cmd, proc.stdout, proc.stderr)
    return ChildPeak(tuple(cmd), returncode, time_v, _maxrss_to_bytes(maxrss), proc.stdout, proc.stderr)


def _parse_time_v(text: str) -> int | None:
    """Bytes from GNU time's 'Maximum resident set size (kbytes): N' line (kbytes means KiB)."""
    m = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", text)
    return int(m.group(1)) * 1024 if m else None


def device_peak_bytes(dev: str | torch.device | None = None) -> int | None:
    """Peak bytes held by tensors on a CUDA device since the last reset; None when not on CUDA."""
    dev = _device(dev)
    if dev.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(dev)


@dataclass(frozen=True)
class PeakMemory:
    """Peak memory around one call, in bytes. See the module docstring for what each number counts."""

    rss_peak_before_bytes: int      # process RSS high-water mark before the call
    rss_peak_after_bytes: int       # ... and after it
    device_peak_bytes: int | None   # CUDA tensors' peak during the call; None off CUDA
    result: Any = None              # what the call returned

    @property
    def rss_peak_growth_bytes(self) -> int:
        """How far the call pushed the process's RSS high-water mark (0 if it stayed under an old peak)."""
        return self.rss_peak_after_bytes - self.rss_peak_before_bytes


def peak_memory(fn: Callable, *args, device: str | torch.device | None = None, **kwargs) -> PeakMemory:
    """Call `fn(*args, **kwargs)` once and report the process RSS high-water mark and the device peak."""
    dev = _device(device)
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    before = peak_rss_bytes()
    result = fn(*args, **kwargs)
    sync(dev)
    return PeakMemory(before, peak_rss_bytes(), device_peak_bytes(dev), result)


def has_time_v() -> bool:
    """Whether GNU time (with -v) is installed at /usr/bin/time."""
    return shutil.which(TIME_BIN) is not None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4   # mallopt parameters, from glibc's <malloc.h>
_MMAP_THRESHOLD_MAX = 32 << 20                      # glibc's largest allowed value on 64-bit machines


def keep_freed_memory(every_size: bool = False) -> bool:
    """Ask the C allocator to keep freed memory in the process instead of handing it back to the OS.

    By default glibc serves a big allocation with a fresh mmap (or trims the heap after a big free), so a
    step that allocates tens of MB of temporaries, layer after layer, page-faults them back in every time:
    measured, that can double a CPU decode step, and whether it happens depends on the allocation history,
    so timings jump between two levels. PyTorch's CUDA caching allocator keeps its blocks for the same
    reason. Allocations up to 32 MB then come from the heap, and the heap is never trimmed.
    `every_size=True` also turns glibc's mmap off (M_MMAP_MAX = 0), so allocations above 32 MB come from the
    heap as well and a freed tensor of hundreds of MB is reused by the next one of its size, not mapped and
    zeroed again: without it, timing an elementwise op on tensors far bigger than the cache times page faults
    (chapter 05's eager rms_norm on 134 MB tensors: 2.8 times its bytes over bandwidth). Freed memory then
    stays with the process until it exits.
    Returns True when set (Linux with glibc), False elsewhere, where nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False   # musl and others: no mallopt
    never_trim = (1 << 31) - 1   # mallopt takes a C int: a larger value wraps, to 0 for 1 << 40 (trim at every free)
    kept = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, never_trim))
    if every_size:
        kept = bool(mallopt(_M_MMAP_MAX, 0)) and kept
    return kept
