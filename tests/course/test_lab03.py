"""Lab 03, the data pipeline: the classroom grader against the real lab.

- the generated lab (labs/) fails: its five code TODOs (profile, prediction, diagnosis, the wrong lever's
  bound, the right lever) are not implemented, and none of the checks they feed passes;
- the committed solution (solutions/) passes every check (nbval re-runs it and compares those lines);
- a learner who names the model (compute) as the bound fails the diagnosis: the check reads their own
  profile; one who bounds the faster model by the data share instead of the model's fails that check.

nbval re-runs the solution, and the untouched lab is replayed in that run (tests/support/lab_grading.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lab_grading import assert_solution_passes, assert_unsolved_fails, assert_mistake_fails, mistake, unsolved

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab03_data_pipeline.ipynb"
LAB = unsolved(SOLUTION, ROOT / "labs" / "lab03_data_pipeline.ipynb")
CHECKS = ("measured", "prediction", "diagnosis", "wrong-lever-bound", "wrong-lever-under-bound",
          "same-scores", "right-beats-wrong", "speedup")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab03_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=5, must_not_pass=CHECKS)


def test_grading_lab03_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


WRONG_DIAGNOSIS = mistake(SOLUTION, "wrong-diagnosis", [
        ('diagnosis = {"bound": "data", "evidence_s": measured["data"], "busy_fraction": prof_slow.busy_fraction}',
         'diagnosis = {"bound": "compute", "evidence_s": measured["compute"], "busy_fraction": prof_slow.busy_fraction}'),
        ('wrong_bound = grading.amdahl(measured["compute"] / prof_slow.wall_s)',
         'wrong_bound = grading.amdahl(measured["data"] / prof_slow.wall_s)'),
    ], through="wrong-lever-bound")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab03_wrong_diagnosis_fails(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, WRONG_DIAGNOSIS, tmp_path, capsys, fails=("wrong-lever-bound",),
                         passes=("measured", "prediction"),
                         says=(r"FAIL\s+diagnosis\s+bound=compute but the measurement says data dominates",))
