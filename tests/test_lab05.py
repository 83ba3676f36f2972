"""Lab 05, memory-bound kernels: the classroom grader against the real lab.

- the generated lab (labs/) fails: its three code TODOs (measure, diagnose, right lever) are not implemented;
- the solution (solutions/) passes every check, through the command line as an instructor runs it;
- a learner who names the matmuls as the bound fails the diagnosis: the check reads their own profile.

`tests/test_labs.py` also runs labs/lab05_memory_bound_kernels.ipynb up to its stubs, and nbval re-runs the solution.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lab_grading import assert_solution_passes, assert_unsolved_fails, grade_edited_solution

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "lab05_memory_bound_kernels.ipynb"
LAB = ROOT / "labs" / "lab05_memory_bound_kernels.ipynb"
CHECKS = ("measured", "diagnosis", "same-outputs", "speedup", "fewer-ops", "bytes")


@pytest.mark.slow
def test_grading_lab05_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, must_not_pass=("diagnosis", "speedup", "same-outputs", "fewer-ops"))


@pytest.mark.slow
def test_grading_lab05_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


@pytest.mark.slow
def test_grading_lab05_wrong_diagnosis_fails(tmp_path, capsys):
    code, out = grade_edited_solution(SOLUTION, [
        ('diagnosis = {"bound": "memory-bound", "evidence_s": measured["memory-bound"]}',
         'diagnosis = {"bound": "matmul", "evidence_s": measured["matmul"]}'),
    ], tmp_path, capsys)
    assert code == 1
    assert re.search(r"FAIL\s+diagnosis\s+bound=matmul but the measurement says memory-bound dominates", out), out
    assert re.search(r"PASS\s+speedup\s", out), out
