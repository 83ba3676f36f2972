"""The chapter 05 Triton kernels on a GPU: time, achieved bandwidth, and the PyTorch reference beside them.

Each kernel runs on one Llama-3-8B-shaped step (`nanoserve.perf.kernel_cost.WORKLOAD`, bf16), timed with
`triton.testing.do_bench` (median). Achieved bandwidth is the kernel's minimum bytes
(`nanoserve.perf.kernel_cost`) over its time, against this GPU's row of `nanoserve.perf.HARDWARE` (its
datasheet bandwidth) and the roofline's predicted time. The peer is the PyTorch reference on the same
inputs: the ratio says what the kernel buys. Results go to benchmarks/results/.

    python benchmarks/kernels.py [--save benchmarks/results]

Needs a CUDA GPU: in Triton's interpreter (the CPU) kernel times mean nothing.
"""
from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

import torch

from nanoserve.course.bench import machine_info, save_record
from nanoserve.perf import kernel_bench as bench, kernel_cost as cost


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU (the interpreter's times mean nothing); "
                         "the chapter 05 notebook shows the predicted GPU times instead")
    rows = bench.measure()
    hw = bench.hardware_row()
    print(f"{torch.cuda.get_device_name()}, bandwidth row {hw.name}: {hw.mem_bw / 1e12:.2f} TB/s; bf16, Llama-3-8B shapes")
    print(f"{'kernel':24s} {'predicted':>10s} {'triton':>10s} {'torch ref':>10s} {'speedup':>8s} "
          f"{'achieved':>11s} {'of peak':>8s}")
    for r in rows:
        print(f"{r['kernel']:24s} {r['predicted_s'] * 1e6:8.1f}us {r['triton_s'] * 1e6:8.1f}us "
              f"{r['torch_s'] * 1e6:8.1f}us {r['torch_s'] / r['triton_s']:7.2f}x "
              f"{r['achieved_bytes_per_s'] / 1e12:7.2f}TB/s {r['fraction_of_peak_bw']:7.0%}"
              + ("   (compute-bound: bandwidth is not its measure)" if r["bound"] == "compute" else ""))
    record = dict(benchmark="kernels", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine_info(), hardware_row=hw.name, dtype="bfloat16", workload=cost.WORKLOAD,
                  results=rows)
    save_record(record, args.save, "kernels")
    return record


if __name__ == "__main__":
    main()
