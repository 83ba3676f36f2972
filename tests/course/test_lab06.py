"""Lab 06, launch overhead: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs (measure, diagnose, the wrong lever's bound, the right
  lever) are not implemented, and none of the checks they feed passes;
- a learner who names the matmuls as the bound, and bounds the attention kernel by the launch share (as if the kernel removed every launch) instead of
  the attention's, fails both checks: they read the learner's own measurements.

nbval re-runs the solution and compares every PASS line, so the solution's passing is checked there; the edited
solution below is one more run (it compiles one graph), the lab one run up to its stubs.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lab_grading import assert_unsolved_fails, assert_mistake_fails, mistake, unsolved

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab06_launch_overhead.ipynb"
LAB = unsolved(SOLUTION, ROOT / "labs" / "lab06_launch_overhead.ipynb")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab06_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4,
                          must_not_pass=("measured", "prediction", "diagnosis", "wrong-lever-bound",
                                         "same-outputs", "no-recompiles", "right-beats-wrong", "speedup"))


WRONG_DIAGNOSIS = mistake(SOLUTION, "wrong-diagnosis", [
        ('diagnosis = {"bound": max(measured, key=measured.get), "evidence_s": max(measured.values())}',
         'diagnosis = {"bound": "work", "evidence_s": measured["work"]}'),
        ('wrong_bound = grading.amdahl(1 - t_attention["without attention"] / t_attention["step"])',
         'wrong_bound = grading.amdahl(measured["launch"] / t_eager[1])'),
    ], through="wrong-lever-bound")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab06_wrong_diagnosis_fails(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, WRONG_DIAGNOSIS, tmp_path, capsys, fails=("wrong-lever-bound",),
                         passes=("measured", "prediction"),
                         says=(r"FAIL\s+diagnosis\s+bound=work but the measurement says launch dominates",))
