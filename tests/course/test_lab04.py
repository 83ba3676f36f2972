"""Lab 04, KV memory: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs are not implemented;
- the committed solution (solutions/) passes every check (nbval re-runs it and compares those lines);
- a learner who predicts the batch from the prompts alone (forgetting that requests grow), diagnoses the wrong
  limit and bounds the wrong lever with the wrong share fails those checks; one who "fixes" the service with the
  wrong lever (a higher max_num_seqs) fails the speed checks: the checks tell right from wrong;
- a learner who sizes the pool without counting the shared header once (32 x 10 blocks with prefix caching
  on) gets every speed check but fails pool-size: the check rewards the smaller, correct arithmetic.

The mistakes are replayed in nbval's run of the solution (tests/support/lab_grading.py), on its own measurements.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lab_grading import assert_solution_passes, assert_unsolved_fails, assert_mistake_fails, mistake, unsolved

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab04_kv_memory.ipynb"
LAB = unsolved(SOLUTION, ROOT / "labs" / "lab04_kv_memory.ipynb")
CHECKS = ("measured", "prediction", "diagnosis", "preemptions-quoted", "wrong-lever-bound", "wrong-lever-under-bound",
          "same-outputs", "no-preemptions", "throughput", "right-beats-wrong", "pool-size")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab04_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4, must_not_pass=(
        "prediction", "diagnosis", "wrong-lever-bound", "wrong-lever-under-bound", "same-outputs", "no-preemptions",
        "throughput", "right-beats-wrong", "pool-size"))


def test_grading_lab04_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


WRONG_DIAGNOSIS = mistake(SOLUTION, "wrong-diagnosis", [
        # the batch predicted from the prompts' blocks alone: requests hold more blocks as they generate
        ("-(-(n + sp.max_tokens) // SERVICE[\"block_size\"]) for n, (_, sp) in zip(prompt_lens, REQUESTS)]\npredicted",
         "-(-n // SERVICE[\"block_size\"]) for n, (_, sp) in zip(prompt_lens, REQUESTS)]\npredicted"),
        ('diagnosis = {"bound": "kv_memory", "evidence_s": measured["kv_memory"],',
         'diagnosis = {"bound": "max_num_seqs", "evidence_s": measured["max_num_seqs"],'),
        # the cap's "bound" from the share of time KV memory limited: a ceiling that allows anything
        ('wrong_bound = grading.amdahl(measured["max_num_seqs"] / sum(measured.values()))\n### END',
         'wrong_bound = grading.amdahl(measured["kv_memory"] / sum(measured.values()))\n### END'),
    ], through="wrong-lever-bound")

# the learner's "fix" is the wrong lever: the deployed pool, a higher concurrency cap
WRONG_LEVER = mistake(SOLUTION, "wrong-lever", [
        ("### END SOLUTION\nfixed = LLM(MODEL, **FIXED)",
         "FIXED = dict(SERVICE, max_num_seqs=64)\n### END SOLUTION\nfixed = LLM(MODEL, **FIXED)"),
    ], through="pool-size")

POOL_WITHOUT_SHARING = mistake(SOLUTION, "pool-without-sharing", [
        ("kv_cache_memory=(shared_blocks + SERVICE[\"max_num_seqs\"] * (longest_blocks - shared_blocks)) * bytes_per_block)",
         "kv_cache_memory=SERVICE[\"max_num_seqs\"] * longest_blocks * bytes_per_block)"),
    ], through="pool-size")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab04_wrong_prediction_diagnosis_and_bound_fail(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, WRONG_DIAGNOSIS, tmp_path, capsys, fails=("prediction", "wrong-lever-bound"),
                         passes=("measured", "preemptions-quoted"),
                         says=(r"FAIL\s+diagnosis\s+bound=max_num_seqs but the measurement says kv_memory dominates",))


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab04_wrong_lever_fails(tmp_path, capsys):
    # preemption keeps the tokens right: the outputs check passes, the speed checks do not
    assert_mistake_fails(SOLUTION, WRONG_LEVER, tmp_path, capsys,
                         fails=("no-preemptions", "throughput", "right-beats-wrong"), passes=("same-outputs",))


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab04_pool_sized_without_sharing_fails_pool_size(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, POOL_WITHOUT_SHARING, tmp_path, capsys,
                         passes=("same-outputs", "no-preemptions", "throughput", "right-beats-wrong"),
                         says=(r"FAIL\s+pool-size\s+320 blocks \(30\.0 MiB\) for 134 needed",))
