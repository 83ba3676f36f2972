"""Lab 07, precision: the classroom grader against the real lab.

- the generated lab (labs/) fails: its four code TODOs (the roofline of both jobs, the diagnoses, the int8
  predictions, the right lever's prediction) are not implemented, and none of the checks they feed passes;
  its stubs are checked from the same run;
- the committed solution (solutions/) passes every check (nbval re-runs it and compares those lines);
- a learner who calls both jobs memory-bound and predicts int8 speeds the scoring job up by the bytes ratio
  fails the scoring diagnosis and the scoring prediction: both checks read the learner's own measurements;
- a learner who guesses "no gain" for the compute-bound job, or sends the bytes ratio through Amdahl there,
  fails the scoring prediction whatever the CPU's kernels measure: the check compares the prediction with the
  lab's model computed from the learner's own timings, not only with a gain that may sit near 1.0;
- the prediction check itself: a number far from the model fails, one near it passes only if it also meets the
  measurement.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from lab_grading import assert_solution_passes, assert_unsolved_fails, assert_mistake_fails, mistake, unsolved
from nanoserve.course import grading, lab07

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab07_precision.ipynb"
LAB = unsolved(SOLUTION, ROOT / "labs" / "lab07_precision.ipynb")
CHECKS = ("measured", "diagnosis-chat", "diagnosis-scoring", "prediction-chat", "prediction-scoring",
          "same-scores", "prediction-right", "right-beats-wrong")
SCORING_SOLUTION = 'predicted_scoring = grading.amdahl(min(1.0, s_parts["linears"] / s_parts["forward"]), local_scoring)'


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab07_unsolved_fails(tmp_path, capsys):
    assert_unsolved_fails(LAB, tmp_path, capsys, todos=4,
                          must_not_pass=("measured", "diagnosis-chat", "diagnosis-scoring", "prediction-chat",
                                         "prediction-scoring", "prediction-right", "right-beats-wrong"))


def test_grading_lab07_solution_passes():
    assert_solution_passes(SOLUTION, CHECKS)


QUANTIZE_EVERYTHING = mistake(SOLUTION, "quantize-everything", [
        ('diagnosis_scoring = {"bound": max(roofline_scoring, key=roofline_scoring.get),\n'
         '                     "evidence_s": max(roofline_scoring.values())}',
         'diagnosis_scoring = {"bound": "memory", "evidence_s": roofline_scoring["memory"]}'),
        (SCORING_SOLUTION, "predicted_scoring = bytes_ratio"),
    ], through="prediction-scoring")


@pytest.mark.slow
@pytest.mark.replays_solution
def test_grading_lab07_quantize_everything_fails(tmp_path, capsys):
    assert_mistake_fails(SOLUTION, QUANTIZE_EVERYTHING, tmp_path, capsys, fails=("prediction-scoring",),
                         passes=("measured", "diagnosis-chat", "prediction-chat"),
                         says=(r"FAIL\s+diagnosis-scoring\s+bound=memory but the measurement says compute dominates",))


def _scoring_check(predicted, measured, s_parts):
    grading.check_prediction("prediction-scoring", predicted, measured, rtol=0.3, unit="×",
                             model=lab07.scoring_model(s_parts))
    return grading.results[-1]


def test_scoring_prediction_tells_a_model_from_a_guess(capsys):
    # an int8 kernel whose compute roof is 1.4x fp32's (a CPU with bf16 units), linears 90% of the forward
    fast = {"linears": 1.4, "linears int8": 1.0, "forward": 1.4 / 0.9}
    model = lab07.scoring_model(fast)
    assert 1.3 < model < 1.4
    assert _scoring_check(model, 1.37, fast).passed
    assert not _scoring_check(1.0, 1.37, fast).passed                     # the old answer, "no gain": a guess
    assert not _scoring_check(grading.amdahl(0.9, 3.99), 1.37, fast).passed   # the bytes ratio through Amdahl
    # a CPU without bf16 units: the int8 kernel's roof is half of fp32's; "no gain" is wrong there too
    slow = {"linears": 1.0, "linears int8": 2.0, "forward": 1.0 / 0.9}
    assert _scoring_check(lab07.scoring_model(slow), 0.55, slow).passed
    assert not _scoring_check(1.0, 0.55, slow).passed
    # the model itself must meet the measurement
    assert not _scoring_check(model, 2.5, fast).passed
    assert "tolerance" in capsys.readouterr().out


def test_chat_model_is_capped_by_the_bytes_ratio():
    parts = {"linears": 30.0, "linears int8": 5.0, "step": 40.0}   # int8 6x faster alone: more than its bytes allow
    assert lab07.chat_model(parts, 3.99) == pytest.approx(grading.amdahl(0.75, 3.99))
    assert lab07.right_model(1536, [384, 64, 64, 64]) == pytest.approx(1536 / 576)
