"""Run notebooks under nbval one at a time, each under its own time limit: `make gpu-check`'s notebooks step.

    python tools/run_notebooks.py --out DIR [--device cuda|cpu] [--limit 120] [NOTEBOOK ...]

Each notebook (default: every chapter and lab solution) runs as its own `pytest --nbval` against its committed
outputs, with the repository's sanitizers, its JUnit XML in DIR/notebooks/ and its log beside it; past --limit
seconds its process group is killed and it counts as timed out, and the next one runs. DIR/notebooks.json says,
per notebook, passed or failed, the cells that failed, the seconds and whether it timed out. --device sets
NANOSERVE_DEVICE for the notebooks (they take their device from `perf.device()`), so the step is exercised on a
CPU before it meets a GPU. Exit status 0 when every notebook passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_notebooks() -> list[Path]:
    """Every chapter and lab solution (the exercises print checks, not outputs to compare: tests/course grades them)."""
    return sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("lab*.ipynb"))


def failed_cells(junit: Path) -> list[str]:
    """The test ids nbval reported as failed or in error (one per cell), from its JUnit XML."""
    if not junit.exists():
        return []
    return [case.get("name", "?") for case in ET.parse(junit).getroot().iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def run_one(notebook: Path, out: Path, limit_s: float, env: dict) -> dict:
    name = notebook.stem
    junit, log = out / f"{name}.xml", out / f"{name}.log"
    # the repository's settings (nbval and its sanitizers) wherever the notebook lies
    cmd = [sys.executable, "-m", "pytest", str(notebook), "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
           "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)    # pytest and the kernel it started
            rc, timed_out = proc.wait(), True
            f.write(f"\n[run_notebooks] killed after the {limit_s:.0f} s limit\n")
    return dict(notebook=str(notebook.relative_to(ROOT)) if notebook.is_relative_to(ROOT) else str(notebook),
                passed=rc == 0 and not timed_out, returncode=rc, timed_out=timed_out,
                seconds=round(time.perf_counter() - start, 1), failed_cells=failed_cells(junit), log=log.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: chapters/*.ipynb and solutions/lab*.ipynb")
    ap.add_argument("--out", type=Path, required=True, help="folder for notebooks.json and notebooks/")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds each notebook may take")
    args = ap.parse_args(argv)
    notebooks = [p.resolve() for p in args.notebooks] or default_notebooks()
    missing = [str(p) for p in notebooks if not p.is_file()]
    if missing:
        ap.error(f"no such notebook: {', '.join(missing)}")
    folder = args.out / "notebooks"
    folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, NANOSERVE_DEVICE=args.device, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    results = []
    for nb in notebooks:
        r = run_one(nb, folder, args.limit, env)
        results.append(r)
        verdict = "passed" if r["passed"] else "TIMED OUT" if r["timed_out"] else f"failed ({len(r['failed_cells'])} cells)"
        print(f"  {r['notebook']:<48} {verdict:<20} {r['seconds']:6.1f} s", flush=True)
    (args.out / "notebooks.json").write_text(json.dumps(dict(device=args.device, limit_s=args.limit,
                                                             notebooks=results), indent=2) + "\n")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
