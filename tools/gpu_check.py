"""Record the GPU evidence in one command: `make gpu-check` (or `python tools/gpu_check.py`).

On a machine with CUDA it runs, one after the other, each under its own time limit so that the whole run
stays under 9.5 minutes (a device command may run 10):
  1. every `gpu`-marked test (`pytest tests -m gpu`), as JUnit XML;
  2. decode latency on the course model, eager vs CUDA graphs at batch 1, 8 and 32
     (benchmarks/decode_latency.py --device cuda);
  3. the Triton kernel benchmark (benchmarks/kernels.py);
  4. the offline benchmark against transformers (`python -m nanoserve bench --device cuda`);
  5. batch-1 decode bandwidth on a real-shape model (benchmarks/decode_bandwidth.py --device cuda);
  6. batch-1 decode latency on the course model and Qwen2.5-0.5B's shape: eager, torch.compile, CUDA
     graphs and transformers' compiled static-cache decode (the named peer);
  7. weight-only quantization: batch-1 decode of Qwen2.5-0.5B's shape in bf16, int8 and int4 (the Triton
     dequant-matmul kernels) against gpt-fast's int8 recipe (benchmarks/quantization.py --device cuda);
  8. the course on CUDA: every chapter and lab solution under nbval against its committed (CPU) outputs, one
     at a time with a limit each (tools/run_notebooks.py): per notebook passed or failed, its failed cells and
     seconds in notebooks.json and summary.json, each one's log and JUnit XML in notebooks/. Steps 1-7 take the
     whole budget, so this one runs only when asked: `--steps notebooks` (ON_REQUEST). `--device cpu` runs it
     on a CPU (and nothing else), which is how the test command checks it before it meets a GPU.
`--steps NAME ...` runs only the named steps (in this order), e.g. when device time is short.
Everything goes to benchmarks/results/gpu-<UTC time>/: machine.json (GPU, driver, torch, CUDA, Triton,
commit, date), each step's log, the benchmarks' JSON records, pytest's junit.xml, and summary.json (each
step's exit status and seconds). Commit that folder.

Without CUDA it says so and exits with status 2, running and writing nothing. Exit status 1 when a step
failed or ran out of time, 0 when all passed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 570          # all steps together: under 9.5 minutes with start-up and machine info
MIN_STEP_S = 15         # a step with less time than this left is skipped, not started
ON_REQUEST = {"notebooks"}   # steps run only when named in --steps


def gpu_test_files() -> list[str]:
    """The test files with a `gpu`-marked test, relative to the repository; the whole-model parity tests last:
    the Mistral bf16 parity test has stalled every recorded run past its timeout, and the files after it with it."""
    files = (str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    return sorted(files, key=lambda f: ("parity" in Path(f).name, f))


def steps(out: Path, device: str = "cuda", notebooks: list[str] | None = None) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds) of each step; the benchmarks save their JSON into `out`."""
    py = sys.executable
    # pytest without the ini's addopts, on the files that hold gpu tests: a GPU image may lack nbval and
    # nbformat (the notebook tests import them), and a collection error would stop every test. One test
    # that hangs fails after 60 s with its stack, and the others still run (the second H200 run lost
    # every test after a hang: the step was killed at its limit, junit.xml unwritten). A hang inside C (a CUDA
    # synchronize, a compiler) never returns to Python, where that timeout acts: faulthandler's watchdog thread
    # dumps every thread's stack into the log at 45 s all the same, so the log says where it stalled.
    # The most telling steps first: a step cut short by the budget loses least there.
    latency = [py, "benchmarks/decode_latency.py", "--device", "cuda", "--save", str(out), "--models"]
    return [
        ("gpu-tests", [py, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider", "-q",
                       "-ra", "--timeout=60", "-o", "faulthandler_timeout=45", f"--junitxml={out / 'junit.xml'}"], 150),
        ("decode-latency-graphs", latency + ["COURSE_MODEL", "--modes", "eager", "cudagraph",
                                             "--batch-sizes", "1", "8", "32"], 45),
        ("kernels", [py, "benchmarks/kernels.py", "--save", str(out)], 40),
        ("offline", [py, "-m", "nanoserve", "bench", "--device", "cuda", "--save", str(out)], 70),
        ("decode-bandwidth", [py, "benchmarks/decode_bandwidth.py", "--device", "cuda", "--dtype", "bfloat16",
                              "--save", str(out)], 35),
        ("decode-latency-all", latency + ["COURSE_MODEL", "qwen2.5-0.5b", "--batch-sizes", "1"], 110),
        ("quantization", [py, "benchmarks/quantization.py", "--device", "cuda", "--save", str(out)], 120),
        ("notebooks", [py, "tools/run_notebooks.py", "--out", str(out), "--device", device, "--limit", "120",
                       *(notebooks or [])], 540),
    ]


def _run(cmd: list[str], *, timeout: float | None = None) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(torch) -> dict:
    """What ran the evidence: GPUs, driver, versions, commit, date (UTC)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    # a copy of the tree made elsewhere (a rented GPU box) may carry a stale .git: NANOSERVE_COMMIT wins
    in_git = _run(["git", "rev-parse", "HEAD"]) and not os.environ.get("NANOSERVE_COMMIT")
    commit = os.environ.get("NANOSERVE_COMMIT") or _run(["git", "rev-parse", "HEAD"])
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpus=[dict(name=g.name, memory_bytes=g.total_memory, capability=f"{g.major}.{g.minor}",
                   multiprocessors=g.multi_processor_count) for g in gpus],
        driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=20) or None,
        torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
        triton=triton_version, python=platform.python_version(), cpu=platform.processor() or platform.machine(),
        cores=os.cpu_count(), commit=commit or None,
        uncommitted_changes=bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])) if in_git else None,
        nvidia_smi=_run(["nvidia-smi"], timeout=20) or None)


def run_step(name: str, cmd: list[str], limit_s: float, log: Path) -> dict:
    """Run one step with its output in `log`; past `limit_s` seconds its whole process group is killed."""
    # the repository on the path: the scripts import nanoserve whether or not it is installed
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n(time limit {limit_s:.0f} s)\n\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the benchmark and any worker it started
            rc, timed_out = proc.wait(), True
            f.write(f"\n[gpu_check] killed after the {limit_s:.0f} s limit\n")
    seconds = time.perf_counter() - start
    return dict(step=name, command=cmd, returncode=rc, timed_out=timed_out, seconds=round(seconds, 1),
                limit_s=round(limit_s), log=log.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results",
                    help="parent folder of the gpu-<UTC time>/ folder (default benchmarks/results)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    ap.add_argument("--steps", nargs="+", metavar="NAME", help="run only these steps (default: all)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run the notebooks step on this CPU, to check it (nothing else runs there)")
    ap.add_argument("--notebooks", nargs="+", metavar="NB", help="the notebooks step's notebooks (default: all)")
    args = ap.parse_args(argv)
    known = [name for name, _, _ in steps(Path("."))]
    unknown = sorted(set(args.steps or ()) - set(known))
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}: expected some of {', '.join(known)}")
    if args.device == "cpu" and not (args.steps and set(args.steps) <= ON_REQUEST):
        ap.error(f"--device cpu runs only {', '.join(sorted(ON_REQUEST))}: name it with --steps")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device (torch.version.cuda = {torch.version.cuda}); "
              "this check records GPU evidence and needs one. Nothing was run or written.", file=sys.stderr)
        return 2
    out = args.results / f"gpu-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    out.mkdir(parents=True)
    info = machine_info(torch)
    (out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"gpu-check: {', '.join(g['name'] for g in info['gpus']) or 'no GPU (--device cpu)'}; torch {info['torch']}, CUDA {info['cuda']}; "
          f"results in {out}")
    deadline = time.perf_counter() + args.budget
    results = []
    for name, cmd, limit in steps(out, args.device, args.notebooks):
        if (name not in args.steps) if args.steps else (name in ON_REQUEST):
            continue
        left = deadline - time.perf_counter()
        if left < MIN_STEP_S:
            results.append(dict(step=name, command=cmd, returncode=None, timed_out=False, seconds=0.0,
                                limit_s=0, log=None, skipped=f"only {left:.0f} s of the budget left"))
            print(f"  {name:<17} skipped: only {left:.0f} s of the {args.budget:.0f} s budget left")
            continue
        r = run_step(name, cmd, min(limit, left), out / f"{name}.log")
        results.append(r)
        verdict = "ok" if r["returncode"] == 0 else "TIMED OUT" if r["timed_out"] else f"FAILED (exit {r['returncode']})"
        print(f"  {name:<17} {verdict:<18} {r['seconds']:6.1f} s   log: {out / r['log']}")
    ok = all(r["returncode"] == 0 for r in results)
    per_notebook = json.loads((out / "notebooks.json").read_text())["notebooks"] if (out / "notebooks.json").exists() else None
    (out / "summary.json").write_text(json.dumps(dict(machine=info["gpus"], device=args.device, ok=ok, steps=results,
                                                      notebooks=per_notebook), indent=2) + "\n")
    print(f"gpu-check: {'all steps passed' if ok else 'some steps failed'}; commit {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
