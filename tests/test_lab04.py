"""Lab 04, KV memory: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs are not implemented;
- the committed solution (solutions/) passes every check (nbval re-runs it and compares those lines);
- a learner who predicts the batch from the prompts alone (forgetting that requests grow), bounds the wrong
  lever with the wrong share, diagnoses the wrong limit and "fixes" the service with the wrong lever (a
  higher max_num_seqs) fails those checks: the checks tell right from wrong;
- a learner who sizes the pool without counting the shared header once (32 x 10 blocks with prefix caching
  on) gets every speed check but fails pool-size: the check rewards the smaller, correct arithmetic.

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
CHECKS = ("measured", "prediction", "diagnosis", "preemptions-quoted", "wrong-lever-bound", "wrong-lever-under-bound",
          "same-outputs", "no-preemptions", "throughput", "right-beats-wrong", "pool-size")


@pytest.mark.slow
def test_grading_lab04_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4, must_not_pass=(
        "prediction", "diagnosis", "wrong-lever-bound", "wrong-lever-under-bound", "same-outputs", "no-preemptions",
        "throughput", "right-beats-wrong", "pool-size"))


def test_grading_lab04_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


@pytest.mark.slow
def test_grading_lab04_wrong_diagnosis_and_wrong_lever_fail(tmp_path, capsys):
    code, out = grade_edited_solution(SOLUTION, [
        # the batch predicted from the prompts' blocks alone: requests hold more blocks as they generate
        ("-(-(n + sp.max_tokens) // SERVICE[\"block_size\"]) for n, (_, sp) in zip(prompt_lens, REQUESTS)]\npredicted",
         "-(-n // SERVICE[\"block_size\"]) for n, (_, sp) in zip(prompt_lens, REQUESTS)]\npredicted"),
        ('diagnosis = {"bound": "kv_memory", "evidence_s": measured["kv_memory"],',
         'diagnosis = {"bound": "max_num_seqs", "evidence_s": measured["max_num_seqs"],'),
        # the cap's "bound" from the share of time KV memory limited: a ceiling that allows anything
        ('wrong_bound = grading.amdahl(measured["max_num_seqs"] / sum(measured.values()))\n### END',
         'wrong_bound = grading.amdahl(measured["kv_memory"] / sum(measured.values()))\n### END'),
        # the learner's "fix" is the wrong lever: the deployed pool, a higher concurrency cap
        ("### END SOLUTION\nfixed = LLM(MODEL, **FIXED)",
         "FIXED = dict(SERVICE, max_num_seqs=64)\n### END SOLUTION\nfixed = LLM(MODEL, **FIXED)"),
    ], tmp_path, capsys)
    assert code == 1
    assert re.search(r"FAIL\s+prediction\s", out), out
    assert re.search(r"FAIL\s+diagnosis\s+bound=max_num_seqs but the measurement says kv_memory dominates", out), out
    for name in ("wrong-lever-bound", "no-preemptions", "throughput", "right-beats-wrong"):
        assert re.search(rf"FAIL\s+{name}\s", out), out
    for name in ("measured", "preemptions-quoted", "wrong-lever-under-bound", "same-outputs"):   # preemption keeps the tokens right
        assert re.search(rf"PASS\s+{name}\s", out), out


@pytest.mark.slow
def test_grading_lab04_pool_sized_without_sharing_fails_pool_size(tmp_path, capsys):
    code, out = grade_edited_solution(SOLUTION, [
        ("kv_cache_memory=(shared_blocks + SERVICE[\"max_num_seqs\"] * (longest_blocks - shared_blocks)) * bytes_per_block)",
         "kv_cache_memory=SERVICE[\"max_num_seqs\"] * longest_blocks * bytes_per_block)"),
    ], tmp_path, capsys)
    assert code == 1
    assert re.search(r"FAIL\s+pool-size\s+320 blocks \(30\.0 MiB\) for 134 needed", out), out
    for name in ("same-outputs", "no-preemptions", "throughput", "right-beats-wrong"):
        assert re.search(rf"PASS\s+{name}\s", out), out
