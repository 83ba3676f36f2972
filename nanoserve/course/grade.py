"""Grade a learner's lab notebook: run it top to bottom and print every check as pass or fail.

    python -m nanoserve.course.grade labs/lab03_data_pipeline.ipynb [--timeout 120] [--save executed.ipynb]
    python -m nanoserve.course.grade submissions/ --csv grades.csv   # a class (below, "Grading a class")

The notebook runs in a fresh kernel of this Python environment (the one that has nanoserve), in the
notebook's own folder, with errors allowed so that one broken cell does not hide the later checks.
Stored outputs are discarded first: only what this run prints counts.

What is counted:
  - every `PASS name: detail` / `FAIL name: detail` line that `nanoserve.course.grading.check` printed;
  - an error in a TODO cell (tagged `raises-exception` by tools/make_labs.py) is a failed check,
    "not implemented" when it is the stub's NotImplementedError;
  - an error in any other cell is a failed check too (a lab must run to the end).
Exit status: 0 when at least one check ran and none failed, 1 otherwise, 2 when the notebook
cannot be read.

This is a classroom convenience, not a proctor: a learner who edits the check cells can print PASS.
"""
from __future__ import annotations

import argparse
import atexit
import csv
import functools
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from nanoserve.course.grading import CheckResult, parse_line

TODO_TAG = "raises-exception"   # the tag tools/make_labs.py puts on every cell with a stub
CURRENT_ENV_KERNEL = "nanoserve-current-env"


def current_env_kernel_manager():
    """A kernel manager that starts an IPython kernel with this very interpreter (sys.executable).

    The notebook's stored kernelspec names whatever kernel its author had; grading and the lab
    tests must run in the environment that has nanoserve installed, whatever Jupyter thinks "python3" is.
    """
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class _CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            if kernel_name == CURRENT_ENV_KERNEL:
                return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                              **ipykernel.kernelspec.get_kernel_dict())
            return super().get_kernel_spec(kernel_name)

    return AsyncKernelManager(kernel_name=CURRENT_ENV_KERNEL, kernel_spec_manager=_CurrentEnvSpecs(),
                              **kernel_sockets())


def kernel_sockets() -> dict:
    """Where a kernel this process starts listens: Unix sockets in a private folder on POSIX, TCP elsewhere.
    Jupyter's default picks five free TCP ports by binding and releasing them, and the kernel binds them a moment
    later: a server or another kernel started in between can take one ("Address already in use"). A socket file
    of our own cannot be taken."""
    if os.name != "posix":
        return {}
    return dict(transport="ipc", ip=os.path.join(_socket_dir(), uuid.uuid4().hex[:12]))


@functools.cache
def _socket_dir() -> str:
    """This process's folder for its kernels' sockets, removed when it exits."""
    path = tempfile.mkdtemp(prefix="nanoserve-kernels-")
    atexit.register(shutil.rmtree, path, True)
    return path


def notebook_client(nb, path: Path, timeout: float):
    """An nbclient client for `nb` (read from `path`) that runs in the current env, in `path`'s folder,
    with a per-cell `timeout` in seconds and errors recorded instead of raised."""
    from nbclient import NotebookClient

    return NotebookClient(nb, km=current_env_kernel_manager(), timeout=int(timeout), allow_errors=True,
                          interrupt_on_timeout=True, record_timing=False,
                          resources={"metadata": {"path": str(path.parent)}})


def is_todo_cell(cell) -> bool:
    return cell.cell_type == "code" and TODO_TAG in cell.metadata.get("tags", [])


def cell_error(cell) -> dict | None:
    """The first error output of an executed code cell, or None."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out
    return None


@dataclass
class Report:
    """The outcome of grading one notebook."""

    path: Path
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.failed


def _checks_in_cell(index: int, cell) -> list[CheckResult]:
    found = []
    text = "".join(out.get("text", "") for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream" and out.get("name") == "stdout")
    for line in text.splitlines():
        result = parse_line(line)
        if result is not None:
            found.append(result)
    err = cell_error(cell)
    if err is not None:
        what = f"{err.get('ename', 'Error')}: {err.get('evalue', '')}".strip()
        if is_todo_cell(cell):
            status = "not implemented" if err.get("ename") == "NotImplementedError" else "error"
            found.append(CheckResult(f"cell {index} (TODO)", False, f"{status}: {what}"))
        else:
            found.append(CheckResult(f"cell {index}", False, f"error: {what}"))
    return found


def collect_checks(nb) -> list[CheckResult]:
    """The checks of an executed notebook, in cell order: each PASS/FAIL line its cells printed, and one failed
    check per cell that raised (a TODO cell's stub reads "not implemented")."""
    return [check for index, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for check in _checks_in_cell(index, cell)]


def grade(path: str | Path, timeout: float = 120.0, save: str | Path | None = None) -> Report:
    """Execute the notebook at `path` and collect its checks (cells numbered from 0, all cell types)."""
    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    report = Report(path)
    start = time.perf_counter()
    try:
        # cleanup_kc: nbclient shuts down only kernels whose manager it made itself, and this one is ours;
        # without it every graded notebook leaves its kernel (and all it allocated) alive until the process exits.
        notebook_client(nb, path, timeout).execute(cleanup_kc=True)
        aborted = None
    except Exception as exc:  # the kernel died or could not be interrupted: grade what ran
        aborted = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    report.seconds = time.perf_counter() - start
    report.checks.extend(collect_checks(nb))
    if aborted is not None:
        report.checks.append(CheckResult("run", False, f"the notebook did not run to the end: {aborted}"))
    if save is not None:
        nbformat.write(nb, str(save))
    return report


def format_report(report: Report) -> str:
    rows = [("result", "check", "detail")] + [
        ("PASS" if c.passed else "FAIL", c.name, c.detail) for c in report.checks]
    width = max(len(r[1]) for r in rows)
    lines = [f"grading {report.path.name} ({report.seconds:.1f} s)"]
    lines += [f"  {res:<6} {name:<{width}}  {detail}" for res, name, detail in rows]
    n_fail = len(report.failed)
    if not report.checks:
        lines.append("no checks ran: this notebook has no grading.check calls, or they never printed")
    else:
        lines.append(f"{len(report.checks) - n_fail} passed, {n_fail} failed")
    return "\n".join(lines)


# --- grading a class ------------------------------------------------------------------------------------------
# A folder of submissions, one sub-folder per learner (ada/lab03_data_pipeline.ipynb, grace/lab03_...). Each
# notebook is graded as above, one after the other. The CSV has one row per learner and notebook: the verdict,
# how many checks passed and failed, why a notebook could not be graded, the seconds, then one column per check
# (PASS or FAIL; empty where that notebook has no such check). A submission that is not a notebook (not JSON,
# empty), was edited until no check runs, or loops forever (interrupted at the cell limit) is a failed row that
# says why; the batch goes on.

@dataclass
class Row:
    """One learner's one notebook."""

    learner: str
    notebook: str
    report: Report | None = None
    problem: str = ""            # why it could not be graded, or why it counts as failed without a failed check
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problem and bool(self.checks) and all(self.checks.values())


def submissions(root: Path) -> list[tuple[str, Path]]:
    """(learner, notebook) for every .ipynb in root/<learner>/ (any depth; Jupyter's checkpoints left out)."""
    found = []
    for learner in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for path in sorted(learner.rglob("*.ipynb")):
            if ".ipynb_checkpoints" not in path.parts:
                found.append((learner.name, path))
    return found


def grade_one(learner: str, path: Path, timeout: float) -> Row:
    row = Row(learner, path.name)
    try:
        row.report = grade(path, timeout=timeout)
    except Exception as exc:   # not JSON, not a notebook, unreadable: this row fails, the batch goes on
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row.problem = f"cannot be read as a notebook: {type(exc).__name__}: {first}"[:300]
        return row
    for check in row.report.checks:
        row.checks[check.name] = row.checks.get(check.name, True) and check.passed
    if not row.checks:
        row.problem = "no check ran (the check cells were removed or never printed)"
    return row


def grade_folder(root: str | Path, timeout: float = 120.0, progress=print) -> list[Row]:
    root = Path(root)
    rows = []
    for learner, path in submissions(root):
        rows.append(grade_one(learner, path, timeout))
        row = rows[-1]
        progress(f"{row.learner}/{row.notebook}: {'PASS' if row.passed else 'FAIL'} "
                 f"({sum(row.checks.values())}/{len(row.checks)} checks){' ' + row.problem if row.problem else ''}")
    return rows


def write_csv(rows: list[Row], path: str | Path) -> None:
    names = list(dict.fromkeys(name for row in rows for name in row.checks))   # first seen first
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["learner", "notebook", "result", "passed", "failed", "problem", "seconds"] + names)
        for row in rows:
            out.writerow([row.learner, row.notebook, "PASS" if row.passed else "FAIL", sum(row.checks.values()),
                          len(row.checks) - sum(row.checks.values()), row.problem,
                          f"{row.report.seconds:.1f}" if row.report else ""]
                         + [("PASS" if row.checks[n] else "FAIL") if n in row.checks else "" for n in names])


def summary(rows: list[Row]) -> str:
    """Per notebook: how many learners handed it in, how many passed every check, the checks failed most."""
    lines = [f"{'notebook':<36} {'learners':>8} {'all passed':>10}  failed most"]
    for notebook in sorted({r.notebook for r in rows}):
        mine = [r for r in rows if r.notebook == notebook]
        misses: dict[str, int] = {}
        for r in mine:
            for name, ok in r.checks.items():
                misses[name] = misses.get(name, 0) + (not ok)
        worst = ", ".join(f"{n} ({k})" for n, k in sorted(misses.items(), key=lambda kv: -kv[1])[:3] if k)
        lines.append(f"{notebook:<36} {len(mine):>8} {sum(r.passed for r in mine):>10}  {worst or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.course.grade", description=__doc__.split("\n")[0])
    parser.add_argument("notebook", help="the learner's lab notebook (.ipynb), or a folder of submissions "
                                         "(one sub-folder per learner)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per cell (default 120)")
    parser.add_argument("--save", metavar="PATH", help="also write the executed notebook here")
    parser.add_argument("--csv", metavar="PATH", default="grades.csv",
                        help="for a folder: the table of results to write (default grades.csv)")
    args = parser.parse_args(argv)
    if Path(args.notebook).is_dir():
        rows = grade_folder(args.notebook, timeout=args.timeout)
        if not rows:
            parser.error(f"no notebooks under {args.notebook!r}: expected one sub-folder of .ipynb files per learner")
        write_csv(rows, args.csv)
        print(summary(rows))
        print(f"{len(rows)} notebooks of {len({r.learner for r in rows})} learners graded: {args.csv}")
        return 0
    if not Path(args.notebook).is_file():
        parser.error(f"notebook {args.notebook!r} does not exist")
    try:
        report = grade(args.notebook, timeout=args.timeout, save=args.save)
    except (nbformat.reader.NotJSONError, nbformat.ValidationError, ValueError) as exc:
        print(f"grade: cannot read {args.notebook}: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
