"""Lab 04, KV memory: the classroom grader against the real lab.

- the generated lab (labs/) fails: its three code TODOs are not implemented;
- the solution (solutions/) passes every check, through the command line as an instructor runs it;
- a learner who diagnoses the wrong limit and "fixes" the service with the wrong lever (a higher
  max_num_seqs) fails the diagnosis and the verification: the checks tell right from wrong.

`tests/test_labs.py` also runs labs/lab04_kv_memory.ipynb up to its stubs, and nbval re-runs the solution.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lab_grading import assert_solution_passes, assert_unsolved_fails, grade_edited_solution

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "lab04_kv_memory.ipynb"
LAB = ROOT / "labs" / "lab04_kv_memory.ipynb"
CHECKS = ("measured", "diagnosis", "preemptions-quoted", "same-outputs", "no-preemptions", "throughput", "pool-size")


@pytest.mark.slow
def test_grading_lab04_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, must_not_pass=("diagnosis", "throughput", "no-preemptions", "same-outputs"))


@pytest.mark.slow
def test_grading_lab04_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


@pytest.mark.slow
def test_grading_lab04_wrong_diagnosis_and_wrong_lever_fail(tmp_path, capsys):
    code, out = grade_edited_solution(SOLUTION, [
        ('diagnosis = {"bound": "kv_memory", "evidence_s": measured["kv_memory"],',
         'diagnosis = {"bound": "max_num_seqs", "evidence_s": measured["max_num_seqs"],'),
        # the learner's "fix" is the wrong lever: the deployed pool, a higher concurrency cap
        ("### END SOLUTION\nfixed = LLM(MODEL, **FIXED)",
         "FIXED = dict(SERVICE, max_num_seqs=64)\n### END SOLUTION\nfixed = LLM(MODEL, **FIXED)"),
    ], tmp_path, capsys)
    assert code == 1
    assert re.search(r"FAIL\s+diagnosis\s+bound=max_num_seqs but the measurement says kv_memory dominates", out), out
    for name in ("no-preemptions", "throughput"):
        assert re.search(rf"FAIL\s+{name}\s", out), out
    for name in ("measured", "preemptions-quoted", "same-outputs"):   # preemption keeps the tokens right
        assert re.search(rf"PASS\s+{name}\s", out), out
