"""Lab 11, the capstone: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs (measure, diagnose, the wrong lever's bound, the levers)
  are not implemented, and none of the checks they feed passes; no server is started for them (each measuring
  cell first asks for the answers it checks);
- a learner who bounds the KV-memory lever by the share of time at a full batch (as if a bigger pool made room
  for more sequences) fails the bound check: it reads the learner's own metrics, where nothing waited for blocks.

nbval re-runs the solution and compares every PASS line, so the solution's passing is checked there: the grader
re-measures the tuned configuration's knee on a fresh server, and the goal is five rungs over the deployed one.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lab_grading import assert_unsolved_fails, assert_mistake_fails, mistake, unsolved

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab11_capstone.ipynb"
LAB = unsolved(SOLUTION, ROOT / "labs" / "lab11_capstone.ipynb")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab11_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4,
                          must_not_pass=("measured", "diagnosis", "prediction", "wrong-lever-bound",
                                         "wrong-lever-within-noise", "levers-written", "goodput", "levers-recorded",
                                         "no-noise-kept", "right-beats-wrong"))


WRONG_BOUND = mistake(SOLUTION, "wrong-bound", [
        ("wrong_bound = grading.amdahl(preempted_share)", "wrong_bound = grading.amdahl(full_batch_share)"),
    ], through="wrong-lever-bound")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab11_wrong_bound_fails(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, WRONG_BOUND, tmp_path, capsys, fails=("wrong-lever-bound",),
                         passes=("measured", "diagnosis", "prediction"),
                         says=(r"FAIL\s+wrong-lever-bound\s+your bound",))
