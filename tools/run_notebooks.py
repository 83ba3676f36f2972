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
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # gpu_check, beside this file
from gpu_check import ROOT, run_step  # noqa: E402


def default_notebooks() -> list[Path]:
    """Every chapter and lab solution (the exercises print checks, not outputs to compare: tests/course grades them)."""
    return sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("lab*.ipynb"))


def failed_cells(junit: Path) -> list[str]:
    """The test ids nbval reported as failed or in error (one per cell), from its JUnit XML."""
    if not junit.exists():
        return []
    return [case.get("name", "?") for case in ET.parse(junit).getroot().iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def run_one(notebook: Path, out: Path, limit_s: float) -> dict:
    """One notebook under nbval, as gpu_check runs a step (its own process group, killed at the limit)."""
    junit = out / f"{notebook.stem}.xml"
    # the repository's settings (nbval and its sanitizers) wherever the notebook lies
    cmd = [sys.executable, "-m", "pytest", str(notebook), "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
           "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
    r = run_step(notebook.stem, cmd, limit_s, out / f"{notebook.stem}.log")
    return dict(notebook=str(notebook.relative_to(ROOT)) if notebook.is_relative_to(ROOT) else str(notebook),
                passed=r["returncode"] == 0 and not r["timed_out"], returncode=r["returncode"],
                timed_out=r["timed_out"], seconds=r["seconds"], failed_cells=failed_cells(junit), log=r["log"])


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
    os.environ["NANOSERVE_DEVICE"] = args.device     # the notebooks' device (perf.device()), for every run below
    results = []
    for nb in notebooks:
        r = run_one(nb, folder, args.limit)
        results.append(r)
        verdict = "passed" if r["passed"] else "TIMED OUT" if r["timed_out"] else f"failed ({len(r['failed_cells'])} cells)"
        print(f"  {r['notebook']:<48} {verdict:<20} {r['seconds']:6.1f} s", flush=True)
    (args.out / "notebooks.json").write_text(json.dumps(dict(device=args.device, limit_s=args.limit,
                                                             notebooks=results), indent=2) + "\n")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
