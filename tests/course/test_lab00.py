"""The fixture lab (tests/fixtures/): its replay in nbval's run of its solution grades as the grader's own run of it.

Like every test_labNN.py, this reads what conftest.py replays in nbval's run of the solution, so it runs in the
same pytest session as the notebooks (`make notebooks`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import lab_grading

from nanoserve.course import grade

TESTS = Path(__file__).resolve().parents[1]
FIXTURE_SOLUTION = TESTS / "fixtures" / "solutions" / "lab00_example.ipynb"
FIXTURE_LAB = TESTS / "fixtures" / "labs" / "lab00_example.ipynb"
lab_grading.unsolved(FIXTURE_SOLUTION, FIXTURE_LAB)   # replayed in nbval's run of the solution


@pytest.mark.replays_solution
def test_a_lab_replayed_in_its_solutions_kernel_grades_as_the_graders_run_of_it(tmp_path):
    """The unsolved labs' tests grade the replay of the lab in nbval's run of its solution
    (tests/support/lab_grading.py): here the fixture lab both ways, with the same checks, verdicts and errors."""
    replayed = lab_grading.UNSOLVED_RUNS.get(FIXTURE_LAB.name)
    if replayed is None:
        pytest.skip("nbval did not run the fixture solution in this session: nothing was replayed")
    lab = tmp_path / FIXTURE_LAB.name
    shutil.copy(FIXTURE_LAB, lab)
    ran = grade.grade(lab).checks
    verdicts = [(c.name, c.passed, c.detail if c.name.startswith("cell ") else None) for c in ran]
    assert [(c.name, c.passed, c.detail if c.name.startswith("cell ") else None)
            for c in grade.collect_checks(replayed)] == verdicts
    assert sum(c.detail.startswith("not implemented") for c in ran) == 3
