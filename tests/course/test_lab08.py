"""Lab 08, communication: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs (measure, diagnose, the wrong lever's bound, the right
  lever) are not implemented, and none of the checks they feed passes;
- a learner who names compute as the bound, and bounds the kernel lever by the communication share, fails
  both checks: they read the learner's own profile.

nbval re-runs the solution and compares every PASS line, so the solution's passing is checked there.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lab_grading import assert_unsolved_fails, assert_mistake_fails, mistake, unsolved

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab08_communication.ipynb"
LAB = unsolved(SOLUTION, ROOT / "labs" / "lab08_communication.ipynb")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab08_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4,
                          must_not_pass=("measured", "prediction", "diagnosis", "wrong-lever-bound",
                                         "right-beats-wrong", "speedup", "same-outputs", "comm-share-down"))


WRONG_DIAGNOSIS = mistake(SOLUTION, "wrong-diagnosis", [
        ('diagnosis = {"bound": max(per_step[0], key=per_step[0].get), "evidence_s": max(per_step[0].values())}',
         'diagnosis = {"bound": "compute", "evidence_s": per_step[0]["compute"]}'),
        ('wrong_bound = grading.amdahl(per_step[0]["compute"] / sum(per_step[0].values()))',
         'wrong_bound = grading.amdahl(per_step[0]["comm"] / sum(per_step[0].values()))'),
    ], through="wrong-lever-bound")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab08_wrong_diagnosis_fails(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, WRONG_DIAGNOSIS, tmp_path, capsys, fails=("wrong-lever-bound",),
                         passes=("measured", "prediction"),
                         says=(r"FAIL\s+diagnosis\s+bound=compute but the measurement says comm dominates",))
