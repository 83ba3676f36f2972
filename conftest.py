"""Test-session setup shared by the engine tests and the notebook tests (nbval). It sits at the repo
root so that `pytest chapters/X.ipynb` run alone gets it too.

- nbval compares stdout, text/plain and the other text outputs; here it is told to skip stderr
  (warnings, progress bars) and rich HTML/SVG renderings (DataFrames, plots), as DESIGN.md asks.
- After the run, each notebook's total time is printed, and notebooks over the 90 s budget are flagged.
- Tests marked `gpu` are skipped when torch sees no CUDA device.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

# The fixture lab pair (tests/fixtures/) exercises tools/make_labs.py, the lab test and the grader
# before any real lab exists. Its solution notebook is collected by nbval like any solution, once,
# through testpaths (`pytest tests/fixtures/solutions/lab00_example.ipynb` runs it alone). The
# generated fixture lab is not: like labs/, it stops at its TODO stubs and has no outputs to compare;
# tests/course/test_labs.py runs it.
collect_ignore_glob = ["tests/fixtures/labs/*",
                       # exercise notebooks print PASS/FAIL checks, not outputs to compare:
                       # tests/course/test_exercises.py
                       # grades each solution (every check passes) and its generated copy (every check fails)
                       "solutions/ex[0-9]*.ipynb"]

# Output keys nbval must not compare (on top of its own list: metadata, traceback, execution_count,
# images, ...). nbval turns each stream output into {"output_type": "stream", <name>: text}, so a
# stream's name is its key: "stderr" drops stderr whether a run has it or not. text/markdown is what
# nanoserve.course.notebook.show() renders engine source as: an edit to the engine must not fail a chapter.
NBVAL_SKIP_COMPARE = ("stderr", "text/html", "image/svg+xml", "text/markdown")

NOTEBOOK_BUDGET_S = 90.0


def _is_nbval_cell(item: pytest.Item) -> bool:
    return type(item).__name__ == "IPyNbCell" and type(item).__module__.startswith("nbval")


def pytest_configure(config: pytest.Config) -> None:
    """nbval's kernels listen on Unix sockets of their own, as the grader's do (nanoserve.course.grade.kernel_sockets):
    on TCP ports picked at random, a kernel starting beside a test's server can lose a port to it."""
    try:
        import nbval.kernel
    except ImportError:
        return
    from jupyter_client.manager import KernelManager

    from nanoserve.course.grade import kernel_sockets

    nbval.kernel.KernelManager = lambda **kw: KernelManager(**kw, **kernel_sockets())


# The unit phase's heaviest files, in seconds on a 2-core CPU (one worker's time in a `make unit` run). Two xdist
# workers take whole files (--dist loadfile) in collection order; the heaviest go first so the workers end together
# (longest job first): in alphabetical order the last worker ran alone for half a minute.
HEAVY_TEST_FILES = {
    "tests/distributed/test_tensor_parallel.py": 73, "tests/course/test_exercises.py": 40,
    "tests/serve/test_serve.py": 39, "tests/course/test_evals.py": 33, "tests/course/test_labs.py": 27,
    "tests/kernels/test_quant.py": 23, "tests/distributed/test_comm.py": 20, "tests/serve/test_profiling.py": 17,
    "tests/serve/test_openai_params.py": 16, "tests/perf/test_gpu_check.py": 15, "tests/kernels/test_kernels.py": 14,
    "tests/serve/test_serve_load.py": 13, "tests/course/test_student_bundle.py": 12,
    "tests/perf/test_quant_benchmark.py": 11, "tests/engine/test_lifecycle.py": 11,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a stable sort: a file's tests keep their order, the files outside the table theirs
    items.sort(key=lambda item: -HEAVY_TEST_FILES.get(item.nodeid.split("::", 1)[0], 0))
    # A lab's mistake tests read what conftest replays in nbval's run of its solution (tests/support/lab_grading.py):
    # they run after the notebooks.
    replays = [item for item in items if item.get_closest_marker("replays_solution")]
    if replays:
        items[:] = [item for item in items if item not in replays] + replays
    needs_cuda = [item for item in items if item.get_closest_marker("gpu")]
    if needs_cuda:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none")
            for item in needs_cuda:
                item.add_marker(skip)

    for item in items:
        if not _is_nbval_cell(item):
            continue
        notebook = item.parent
        current = getattr(notebook, "skip_compare", None)
        if not isinstance(current, tuple):
            # nbval keeps the keys it does not compare in IPyNbFile.skip_compare (0.9 to 0.11).
            # If that changes, fail loudly rather than silently comparing stderr again.
            raise pytest.UsageError(
                f"nbval {_nbval_version()}: IPyNbFile.skip_compare is {current!r}, expected a tuple; "
                "conftest.py cannot turn off stderr/HTML comparison with this version")
        missing = tuple(k for k in NBVAL_SKIP_COMPARE if k not in current)
        if missing:
            notebook.skip_compare = current + missing


def _nbval_version() -> str:
    try:
        import nbval

        return nbval.__version__
    except Exception:  # pragma: no cover - only for the error message
        return "(unknown version)"


# --- per-notebook run time --------------------------------------------------------------------
# Each nbval cell is one test; the kernel starts in the first cell's setup and stops in the last
# cell's teardown, so summing every phase of every cell gives the notebook's full run time.
_notebook_seconds: dict[str, float] = defaultdict(float)
_replay_seconds: dict[str, float] = defaultdict(float)   # learners' runs replayed in a notebook's kernel: not its time


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        _notebook_seconds[path] += report.duration


def pytest_report_header(config) -> str:
    """The CPU the run landed on, in the report's header: lessons that measure depend on it (BF16 and AMX units, the
    vendor's kernels), so a red run on one CPU and a green one on another must say which was which."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "cpu: unknown (no /proc/cpuinfo)"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    units = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    # `make test-cpu`: the instruction set emulated
    held = [f"{var}={os.environ[var]}" for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(var)]
    return (f"cpu: {model}, {info.count('processor')} logical cores, {' '.join(units) or 'no AVX2'}"
            + (f"; kernels held to {', '.join(held)}" if held else ""))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _notebook_seconds:
        return
    tr = terminalreporter
    tr.write_sep("=", "notebook run times (all cells, kernel start included)")
    over = 0
    own = {path: seconds - _replay_seconds.get(path, 0.0) for path, seconds in _notebook_seconds.items()}
    for path, seconds in sorted(own.items(), key=lambda kv: -kv[1]):
        flag = ""
        if seconds > NOTEBOOK_BUDGET_S:
            flag, over = f"  OVER the {NOTEBOOK_BUDGET_S:.0f} s budget", over + 1
        tr.write_line(f"{seconds:8.1f} s  {path}{flag}", red=bool(flag))
    total = sum(own.values())
    tr.write_line(f"{total:8.1f} s  total, {len(_notebook_seconds)} notebooks, {over} over budget")
    for path, seconds in sorted(_replay_seconds.items()):
        tr.write_line(f"{seconds:8.1f} s  of learners' runs (mistakes, the untouched lab) replayed in {path}'s kernel "
                      f"(not counted above)")


# --- learners' runs replayed in nbval's run of a lab solution (tests/support/lab_grading.py): each registered mistake
# after the cell printing its check, and the untouched lab after the last cell ----------------------------
_cells_run: dict[str, list[tuple[str, str]]] = defaultdict(list)   # notebook -> (source, printed text) per cell
_REPLAY_TIMEOUT_S = 300
_learners: dict[str, tuple] = {}   # solution name -> lab_grading.learner_cells of its registered lab


def _printed(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _run_in_kernel(kernel, code: str) -> str:
    """Execute `code` in nbval's kernel for this notebook; return what it printed (and an error, if one)."""
    msg_id = kernel.execute_cell_input(code, allow_stdin=False)
    kernel.await_reply(msg_id, timeout=_REPLAY_TIMEOUT_S)
    printed = []
    while True:
        msg = kernel.get_message(stream="iopub", timeout=_REPLAY_TIMEOUT_S)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return "".join(printed)
        if kind == "stream" and content.get("name") == "stdout":
            printed.append(content["text"])
        elif kind == "error":
            printed.append(f"replay raised {content['ename']}: {content['evalue']}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    import sys
    lab_grading = sys.modules.get("lab_grading") if _is_nbval_cell(item) else None
    name = item.path.name
    if lab_grading is None or getattr(item.parent, "kernel", None) is None or \
            (name not in lab_grading.MISTAKES and name not in lab_grading.UNSOLVED):
        yield
        return
    lab = lab_grading.UNSOLVED.get(name)
    if lab is not None and name not in _learners:
        _learners[name] = lab_grading.learner_cells(item.path, lab)
    learner = _learners.get(name)
    if learner is not None and item.cell_num == learner[2]:
        _run_in_kernel(item.parent.kernel, lab_grading.snapshot_code())   # before the solution's first TODO cell
    yield
    _cells_run[name].append((item.cell.source, _printed(getattr(item, "test_outputs", None) or [])))
    _replay_mistakes(item, lab_grading)
    if learner is not None and item.cell_num == len(learner[1]) - 1:   # after the mistakes: it runs the lab's
        _replay_unsolved(item, lab_grading, lab, *learner)            # given measurements on shared objects


def _replay_unsolved(item, lab_grading, lab, nb, code, first) -> None:
    """After the solution's last cell: the lab's cells from its first TODO on (tests/support/lab_grading.py)."""
    start = time.perf_counter()
    lab_grading.replay_learner(lambda python: _run_in_kernel(item.parent.kernel, python), item.path, lab, code,
                               first, [text for _, text in _cells_run[item.path.name]])
    lab_grading.UNSOLVED_RUNS[lab.name] = nb
    _replay_seconds[item.nodeid.split("::", 1)[0]] += time.perf_counter() - start


def _replay_mistakes(item, lab_grading) -> None:
    name = item.path.name
    if name not in lab_grading.MISTAKES:
        return
    committed = _printed(item.cell.get("outputs", []))
    for mistake_id, (edits, through) in lab_grading.MISTAKES[name].items():
        if not lab_grading.prints_check(committed, through):
            continue
        kept, cells = lab_grading.replay_plan(item.path, edits, through)
        earlier = "".join(text for source, text in _cells_run[name] if source in kept)
        start = time.perf_counter()
        lab_grading.REPLAYS[(name, mistake_id)] = earlier + _run_in_kernel(item.parent.kernel,
                                                                            lab_grading.replay_code(cells))
        _replay_seconds[item.nodeid.split("::", 1)[0]] += time.perf_counter() - start
