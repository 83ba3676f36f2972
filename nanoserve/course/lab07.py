"""Lab 07's model of the system, which its prediction checks compare a learner's numbers with.

Each function takes the learner's own measurements (the dicts the lab's timing cells fill) and returns what the
lab's model predicts from them, so that `grading.check_prediction(..., model=...)` can tell a prediction made from
the model from a round guess that happens to sit near the measured gain:

- `chat_model`: int8 on a memory-bound decode step is Amdahl over the linear layers' share of the step, sped up
  by what int8 did to those layers alone at one token, which fewer bytes cap at the bytes ratio;
- `scoring_model`: int8 on a compute-bound forward is Amdahl over the linear layers' share of it, sped up by the
  ratio of the two kernels' compute roofs at that shape (the bytes do not enter);
- `right_model`: scoring documents by length instead of padded does the FLOPs of the real tokens only.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from nanoserve.course.grading import amdahl


def _share(part: float, whole: float) -> float:
    return min(1.0, part / whole)


def chat_model(t_parts: Mapping[str, float], bytes_ratio: float) -> float:
    """int8's gain on the chat step from `t_parts` ("linears", "linears int8", "step": seconds)."""
    local = min(bytes_ratio, t_parts["linears"] / t_parts["linears int8"])
    return amdahl(_share(t_parts["linears"], t_parts["step"]), local)


def scoring_model(s_parts: Mapping[str, float]) -> float:
    """int8's gain on the padded scoring batch from `s_parts` ("linears", "linears int8", "forward": seconds of
    one padded document)."""
    return amdahl(_share(s_parts["linears"], s_parts["forward"]), s_parts["linears"] / s_parts["linears int8"])


def right_model(padded_tokens: int, lengths: Sequence[int]) -> float:
    """Scoring by length: the padded batch's tokens over the real ones (both sides compute-bound)."""
    return padded_tokens / sum(lengths)
