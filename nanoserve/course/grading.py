"""Checks inside lab notebooks, printed as PASS/FAIL lines that the classroom grader collects.

    from nanoserve.course import grading
    grading.check("speedup", after_s < before_s / 2, f"{before_s:.3f} s -> {after_s:.3f} s")
    grading.check_diagnosis(diagnosis, measured)     # the Diagnose step of every lab

A check never raises: a failed check prints a FAIL line and the notebook runs on, so one run of
`python -m nanoserve.course.grade notebook.ipynb` reports every check of a lab, not just the first failure.
Each check prints exactly one line, `PASS <name>: <detail>` or `FAIL <name>: <detail>`; the grader
reads those lines back from the executed notebook's outputs (see `parse_line`).

Put numbers in `detail` with their units ("0.051 s", "12.3 tokens/s") and ratios with the sign ×
("1.42×"): the course's nbval sanitizer hides such values when it compares a solution notebook's
outputs, so a PASS line stays comparable across machines while the learner still sees their own numbers.

Every lab grades the same steps with the same checks:
    grading.check_prediction("prediction", predicted_s, measured_s, rtol=0.3)   # Diagnose: a model of the system
    bound = grading.amdahl(fraction, speedup)                                  # the wrong lever's ceiling
    grading.check_under_bound("wrong-lever-bound", wrong_gain, bound)          # ... never exceeded
    grading.check_beats("right-beats-wrong", right_gain, wrong_gain, margin=1.15)
"""
from __future__ import annotations

import math
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Mapping

# `PASS name: detail`; the name is everything up to the first ": " (names have no colon).
_LINE = re.compile(r"^(PASS|FAIL) ([^:\n]+): ?(.*)$")


@dataclass(frozen=True)
class CheckResult:
    """One check: its name, whether it passed, and the evidence (with units) it was judged on."""

    name: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.name}: {self.detail}"


results: list[CheckResult] = []  # every check made in this process (this kernel), in order


def check(name: str, passed: bool, detail: str = "") -> None:
    """Record and print one check as `PASS name: detail` or `FAIL name: detail`.

    `name` is a short identifier (no colon or newline); `detail` is one line of evidence. Nothing is
    returned, so a check as a cell's last line echoes nothing; `results[-1].passed` has the verdict.
    """
    name = str(name).strip()
    if not name or ":" in name or "\n" in name:
        raise ValueError(f"check name {name!r} must be non-empty, one line, and contain no ':'")
    result = CheckResult(name, bool(passed), " ".join(str(detail).split()))
    results.append(result)
    print(result.line(), flush=True)


def check_diagnosis(diagnosis: object, measured: Mapping[str, float], *, name: str = "diagnosis",
                    rtol: float = 0.25, busy_fraction: float | None = None, busy_atol: float = 0.05,
                    tie_rtol: float = 0.0) -> None:
    """Check a diagnosis written as data against the learner's own measurement.

    `measured` maps each category to the seconds spent in it (e.g. `{"data": 0.21, "compute": 0.01}`,
    or `perf.profile(...).breakdown()`). `diagnosis` must be a dict with
      - "bound": the category that dominates, i.e. the largest entry of `measured`, and
      - "evidence_s": the seconds quoted for it, within `rtol` (relative) of `measured[bound]`;
      - "busy_fraction", only when `busy_fraction` (the measured accelerator busy fraction, e.g.
        `prof.busy_fraction`) is given: the fraction quoted, within `busy_atol` of it.
    With `tie_rtol`, every category within that fraction of the largest is a bound too (two that measure alike are
    a tie, which noise decides): naming any of them passes, and a PASS line is the same whichever was named and
    whether or not this run's numbers tied (nbval compares it with the committed run's).
    A malformed diagnosis is a FAIL with the reason, not an exception.
    """
    if not measured:
        check(name, False, "the measurement is empty: measure before diagnosing")
        return
    largest = max(measured, key=lambda k: measured[k])
    table = ", ".join(f"{k} {float(v):.4f} s" for k, v in measured.items())
    if not isinstance(diagnosis, Mapping) or "bound" not in diagnosis or "evidence_s" not in diagnosis:
        check(name, False, f"expected a dict with keys 'bound' and 'evidence_s', got {diagnosis!r}")
        return
    bound, evidence = diagnosis["bound"], diagnosis["evidence_s"]
    if bound not in measured:
        check(name, False, f"bound {bound!r} is not a measured category ({', '.join(map(str, measured))})")
        return
    if not isinstance(evidence, (int, float)) or isinstance(evidence, bool) or not math.isfinite(evidence):
        check(name, False, f"evidence_s must be a number of seconds, got {evidence!r}")
        return
    tied = [k for k in measured if float(measured[k]) >= (1.0 - tie_rtol) * float(measured[largest])]
    if bound not in tied:
        check(name, False, f"bound={bound} but the measurement says {largest} dominates ({table})")
        return
    actual = float(measured[bound])
    if abs(evidence - actual) > rtol * abs(actual):
        check(name, False, f"evidence_s {evidence:.4f} s does not match the measured {bound} "
                    f"time {actual:.4f} s (tolerance {rtol:.0%})")
        return
    busy = ""
    if busy_fraction is not None:
        quoted = diagnosis.get("busy_fraction")
        if not isinstance(quoted, (int, float)) or isinstance(quoted, bool) or not math.isfinite(quoted):
            check(name, False, f"expected 'busy_fraction': the measured accelerator busy fraction "
                               f"(0 to 1), got {quoted!r}")
            return
        if abs(quoted - busy_fraction) > busy_atol:
            check(name, False, f"busy_fraction {quoted:.3f} does not match the measured "
                               f"{busy_fraction:.3f} (tolerance {busy_atol})")
            return
        busy = ", busy fraction as measured"   # no bare number: PASS lines must compare across machines
    named = f"bound={bound}" if not tie_rtol else \
        f"the bound named is the largest or within {tie_rtol:.0%} of it (closer than that is a tie, which noise decides)"
    check(name, True, f"{named}, evidence {evidence:.4f} s{busy} ({table})")


def answered(*names: str) -> None:
    """Stop a measuring cell before it measures when an answer it checks is not written yet.

    A lever's measurement takes seconds to a minute and ends in a check against the learner's answer (a bound,
    a prediction): the cell's first line names those answers, so an unanswered TODO costs a clear error at
    once, not a measurement and then a NameError. Looks the names up in the caller's globals (the notebook)."""
    defined = sys._getframe(1).f_globals
    missing = [name for name in names if name not in defined]
    if missing:
        raise NameError(f"{', '.join(missing)} not defined yet: write it in the TODO cell above first. "
                        f"This cell measures the lever and checks it against your answer.")


def amdahl(fraction: float, speedup: float = math.inf) -> float:
    """The most the whole can speed up when a lever speeds up `fraction` of its time by `speedup`
    (Amdahl's law: 1 / ((1 - f) + f / s)); with the default, the part becomes free."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be between 0 and 1 (a share of the measured time), got {fraction!r}")
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup!r}")
    return 1.0 / ((1.0 - fraction) + fraction / speedup)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_prediction(name: str, predicted: object, measured: float, *, rtol: float, unit: str = "s",
                     model: float | None = None, model_rtol: float = 0.1, noise: float | None = None) -> None:
    """A prediction from a model of the system (reads × latency, bytes ÷ bandwidth, ...) against the
    learner's own measurement: PASS when it is within `rtol` (relative) of `measured`.
    `unit` is printed after both numbers ("s", "ms", "blocks"; "×" for a predicted ratio).

    `model`: what the lab's model of the system gives from the learner's own earlier measurements (the
    inputs the prediction was to be made from). When given, the prediction must also be within `model_rtol`
    of it: where the measured outcome is close to a round guess ("no gain", 1.0), a guess would otherwise
    pass, and the check could not tell a model from a guess.

    `noise`: the measurement's own run-to-run spread (same unit). A prediction cannot be graded more finely
    than the timing it is compared with, so the tolerance is `rtol` or twice the noise, whichever is larger."""
    if not _number(predicted):
        check(name, False, f"the prediction must be a number ({unit}), got {predicted!r}")
        return
    if not _number(measured) or measured == 0:
        check(name, False, f"the measurement is {measured!r}: measure before predicting")
        return
    sep = "" if unit == "×" else " "
    detail = f"predicted {predicted:.4g}{sep}{unit}, measured {measured:.4g}{sep}{unit}"
    if model is not None:
        if not _number(model) or model == 0:
            check(name, False, f"the model's value is {model!r}: measure its inputs before predicting")
            return
        if abs(predicted - model) > model_rtol * abs(model):
            check(name, False, f"predicted {predicted:.4g}{sep}{unit}, but the model gives {model:.4g}{sep}{unit} "
                               f"from your measurements (tolerance {model_rtol:.0%}): predict from the model, not a guess")
            return
        detail = (f"predicted {predicted:.4g}{sep}{unit} (the model {model:.4g}{sep}{unit}, tolerance {model_rtol:.0%}), "
                  f"measured {measured:.4g}{sep}{unit}")
    allowed = rtol * abs(measured)
    tolerance = f"tolerance {rtol:.0%}"
    if noise is not None and _number(noise):
        allowed = max(allowed, 2 * abs(noise))
        tolerance += f", or twice the measurement's spread ({noise:.4g}{sep}{unit}) if larger"
    check(name, abs(predicted - measured) <= allowed, f"{detail} ({tolerance})")


def check_bound(name: str, bound: object, model: float, *, rtol: float = 0.02) -> None:
    """A bound the learner derived (Amdahl's law over the shares they measured) against what the lab's model
    derives from the same measurements. Nothing is measured yet: this grades the derivation, and the lever's
    measured gain is checked against the bound later (`check_under_bound`)."""
    if not _number(bound) or bound < 1.0:
        check(name, False, f"the bound must be a speed-up of at least 1 (old time / new time), got {bound!r}")
        return
    check(name, abs(bound - model) <= rtol * abs(model),
          f"your bound {bound:.3f}×, Amdahl's law over your measured shares {model:.3f}× (tolerance {rtol:.0%}); "
          f"the lever is measured against it below")


def check_under_bound(name: str, gain: float, bound: object, *, slack: float = 0.05,
                      round_gains: list[float] | None = None) -> None:
    """A lever's measured gain (old time / new time) stays under the bound the profile gave it, within
    `slack` for noise. A gain above its bound means the profile mis-attributed the time.

    A lever whose bound is near 1 is measured near its bound, where the noise of a shared machine decides as often
    as the lever does. Given `round_gains` (one gain per interleaved round, at least three, from the rounds `gain` was measured over),
    the check allows the larger of `slack` and their noise: a median of n rounds scatters by about 1.25 standard
    deviations over sqrt(n), and it allows three of those."""
    if not _number(bound) or bound < 1.0:
        check(name, False, f"the bound must be a speed-up of at least 1 (old time / new time), got {bound!r}")
        return
    if round_gains is None or len(round_gains) < 3:
        check(name, gain <= bound * (1.0 + slack),
              f"measured {gain:.2f}× against a bound of {bound:.2f}× (slack {slack:.0%})")
        return
    n = len(round_gains)
    allowed = max(slack * bound, 3 * 1.25 * statistics.stdev(round_gains) / math.sqrt(n))
    check(name, gain <= bound + allowed,
          f"measured {gain:.2f}× against a bound of {bound:.2f}× plus {allowed:.3f}× (the larger of {slack:.0%} and "
          f"the run-to-run noise of the gain, 3 standard errors of the median of {n} rounds)")


def check_beats(name: str, right_gain: float, wrong_gain: float, *, margin: float) -> None:
    """The right lever's gain beats the wrong lever's by at least `margin` (a ratio of the two gains),
    both measured by the learner against the same baseline."""
    check(name, right_gain >= wrong_gain * margin,
          f"right lever {right_gain:.2f}×, wrong lever {wrong_gain:.2f}× (needs {margin:.2f}× between them)")


def parse_line(line: str) -> CheckResult | None:
    """The check printed on `line`, or None if the line is not a check line."""
    m = _LINE.match(line.rstrip("\r\n"))
    if m is None:
        return None
    return CheckResult(m.group(2).strip(), m.group(1) == "PASS", m.group(3).strip())


def reset() -> None:
    """Forget the checks recorded so far (e.g. when re-running a lab from the top)."""
    results.clear()
