"""Exercise notebooks: each solution passes every check; its generated copy (labs/) fails every one.

Each exercise runs once here, in one kernel: the solution, its checks read as the grader (`nanoserve.course.grade`)
reads them, then the learner's copy as `tools/make_labs.py` writes it, replayed in the same kernel from its first
TODO cell on (tests/support/lab_grading.py: up to there the copy is the solution). nbval does not run them
(conftest.py): their outputs are the check lines this test reads. Two exercises run at a time (`graded`): their
checks are about correctness, not speed, and most of a run is one busy thread (starting a kernel, importing torch).
"""
import time
from pathlib import Path

import nbformat
import pytest
import torch

import lab_grading

from nanoserve.course import grade
from nanoserve.course.exercises import check, first_mismatch

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = sorted((ROOT / "solutions").glob("ex[0-9]*.ipynb"))
BUDGET_S = 60.0


def test_first_mismatch_names_the_tensor_the_position_and_the_size():
    a = torch.zeros(2, 3)
    b = a.clone()
    b[1, 2] = 0.5
    assert first_mismatch(a, a) is None
    assert first_mismatch(a, b, "layers[2].mlp") == \
        "layers[2].mlp[1, 2]: got 0, expected 0.5 (off by 5.0e-01); 1 of 6 elements differ"
    assert first_mismatch(a, torch.zeros(3, 2), "h") == "h: shape (2, 3), expected (3, 2)"
    assert first_mismatch([1, 2, 3], [1, 2, 4], "tokens") == "tokens[2]: got 3, expected 4"
    assert first_mismatch([1, 2], [1, 2, 3], "tokens") == "tokens: 2 items, expected 3 (the first 2 match)"
    assert first_mismatch({"a": [1]}, {"a": [2]}, "out") == "out['a'][0]: got 1, expected 2"


def test_check_reports_a_todo_and_an_error_as_failures(capsys):
    def todo():
        raise NotImplementedError("TODO: write it")

    assert not check("todo", todo, 1)
    assert not check("broken", lambda: [][1], 1)
    assert check("right", lambda: torch.ones(2), torch.ones(2))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "FAIL todo: not implemented yet (the TODO in your function raised NotImplementedError)"
    assert out[1].startswith("FAIL broken: IndexError: list index out of range")
    assert out[2] == "PASS right: matches the reference (max |diff| 0.0e+00)"


def solution_and_copy(solution: Path) -> tuple[grade.Report, grade.Report]:
    """The grader's report on an exercise's solution, and on the learner's copy (labs/) replayed in the same
    kernel after it (tests/support/lab_grading.py): up to its first TODO the copy is the solution, so its run
    there is the solution's, and from there its cells run on the namespace the solution had at that point."""
    lab = ROOT / "labs" / solution.name
    copy, copy_code, first = lab_grading.learner_cells(solution, lab)
    nb = nbformat.read(str(solution), as_version=4)
    client = grade.notebook_client(nb, solution, timeout=120)

    def run(python: str) -> str:   # executes in the kernel; returns what it printed
        nb.cells.append(nbformat.v4.new_code_cell(python))   # nbclient stores an executed cell back at its index
        cell = client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
        nb.cells.pop()
        return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")

    start = time.perf_counter()
    with client.setup_kernel(cleanup_kc=True):   # our kernel manager: nbclient would leave it running
        code = [(index, cell) for index, cell in enumerate(nb.cells) if cell.cell_type == "code"]
        for k, (index, cell) in enumerate(code):
            cell.outputs, cell.execution_count = [], None
            if k == first:
                run(lab_grading.snapshot_code())
            client.execute_cell(cell, index)
        solved_s = time.perf_counter() - start
        printed = ["".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout") for _, cell in code]
        # every cell from the first TODO runs again (keep=False): an exercise's checks reach the learner's code
        # through the engine too (a patched function), which the names a cell reads do not show
        lab_grading.replay_learner(run, solution, lab, copy_code, first, printed, keep=False)
    return (grade.Report(solution, grade.collect_checks(nb), solved_s),
            grade.Report(lab, grade.collect_checks(copy), time.perf_counter() - start - solved_s))


@pytest.fixture(scope="module")
def graded():
    """Every exercise's solution and learner's copy, graded two exercises at a time."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = dict(zip(EXERCISES, pool.map(solution_and_copy, EXERCISES)))
    return {path: report for solution, pair in reports.items()
            for path, report in zip((solution, ROOT / "labs" / solution.name), pair)}


@pytest.mark.slow
@pytest.mark.parametrize("solution", EXERCISES, ids=lambda p: p.stem)
def test_the_solution_passes_every_check_and_the_learners_copy_fails_every_one(solution, graded):
    solved = graded[solution]
    names = [c.name for c in solved.checks]
    assert len(names) >= 2, f"{solution.name}: {len(names)} checks"
    assert all(c.passed for c in solved.checks), [c.line() for c in solved.checks if not c.passed]
    # graded beside another notebook: the budget is twice a notebook's alone
    assert solved.seconds < 2 * BUDGET_S, f"{solution.name} took {solved.seconds:.0f} s (budget {2 * BUDGET_S:.0f} s " \
                                           f"on 2 cores, beside another notebook)"
    learner = graded[ROOT / "labs" / solution.name]
    assert [c.name for c in learner.checks] == names, "the learner's copy must run every check"
    assert not any(c.passed for c in learner.checks), [c.line() for c in learner.checks if c.passed]
