"""Exercise notebooks: each solution passes every check; its generated copy (labs/) fails every one.

Each exercise notebook runs twice here, in the grader (`nanoserve.course.grade`): the solution, and the
learner's copy as `tools/make_labs.py` writes it. nbval does not run them (conftest.py): their outputs are
the check lines this test reads.
"""
from pathlib import Path

import pytest
import torch

from nanoserve.course import grade
from nanoserve.course.exercises import check, first_mismatch

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.mark.slow
@pytest.mark.parametrize("solution", EXERCISES, ids=lambda p: p.stem)
def test_the_solution_passes_every_check_and_the_learners_copy_fails_every_one(solution, tmp_path):
    import time
    t = time.perf_counter()
    solved = grade.grade(solution)
    elapsed = time.perf_counter() - t
    names = [c.name for c in solved.checks]
    assert len(names) >= 2, f"{solution.name}: {len(names)} checks"
    assert all(c.passed for c in solved.checks), [c.line() for c in solved.checks if not c.passed]
    assert elapsed < BUDGET_S, f"{solution.name} took {elapsed:.0f} s (budget {BUDGET_S:.0f} s on 2 cores)"
    learner = grade.grade(ROOT / "labs" / solution.name)
    assert [c.name for c in learner.checks] == names, "the learner's copy must run every check"
    assert not any(c.passed for c in learner.checks), [c.line() for c in learner.checks if c.passed]
