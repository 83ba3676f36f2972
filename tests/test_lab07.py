"""Lab 07, precision: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs (the roofline of both jobs, the diagnoses, the int8
  predictions, the right lever's prediction) are not implemented, and none of the checks they feed passes;
  its stubs are checked from the same run;
- the committed solution (solutions/) passes every check (nbval re-runs it and compares those lines);
- a learner who calls both jobs memory-bound and predicts int8 speeds the scoring job up by the bytes ratio
  fails the scoring diagnosis and the scoring prediction: both checks read the learner's own measurements.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lab_grading import assert_solution_passes, assert_unsolved_fails, grade_edited_solution

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "lab07_precision.ipynb"
LAB = ROOT / "labs" / "lab07_precision.ipynb"
CHECKS = ("measured", "diagnosis-chat", "diagnosis-scoring", "prediction-chat", "prediction-scoring",
          "same-scores", "prediction-right", "right-beats-wrong")


@pytest.mark.slow
def test_grading_lab07_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4,
                          must_not_pass=("measured", "diagnosis-chat", "diagnosis-scoring", "prediction-chat",
                                         "prediction-scoring", "prediction-right", "right-beats-wrong"))


def test_grading_lab07_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


@pytest.mark.slow
def test_grading_lab07_quantize_everything_fails(tmp_path, capsys):
    code, out = grade_edited_solution(SOLUTION, [
        ('diagnosis_scoring = {"bound": max(roofline_scoring, key=roofline_scoring.get),\n'
         '                     "evidence_s": max(roofline_scoring.values())}',
         'diagnosis_scoring = {"bound": "memory", "evidence_s": roofline_scoring["memory"]}'),
        ("predicted_scoring = 1.0", "predicted_scoring = bytes_ratio"),
    ], tmp_path, capsys, through="prediction-scoring")
    assert code == 1
    assert re.search(r"FAIL\s+diagnosis-scoring\s+bound=memory but the measurement says compute dominates", out), out
    assert re.search(r"FAIL\s+prediction-scoring\s", out), out
    for name in ("measured", "diagnosis-chat", "prediction-chat"):
        assert re.search(rf"PASS\s+{name}\s", out), out
