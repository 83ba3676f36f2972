"""Chapter 10: verifying k proposed tokens so that the output is exactly what the target alone would give.

The target scores the last token and the k draft tokens in one forward: k + 1 distributions p_1 .. p_k+1,
p_i being the target's distribution for the i-th new token given everything before it. Walk the drafts in
order:

- greedy: accept d_i while it is the target's argmax; the first mismatch is replaced by the argmax, and
  when all k match the target's next argmax comes free (the "bonus" token). The output is token for token
  the target's greedy output.
- sampled (modified rejection sampling, Leviathan et al. and Chen et al., 2023): accept d_i with
  probability min(1, p_i(d_i) / q_i(d_i)), q_i being the distribution the draft was drawn from; on the first
  rejection draw the replacement from the residual (p_i - q_i)+, normalised; when all k are accepted draw the
  bonus from p_k+1. Each emitted token is then distributed exactly as the target's would be. A proposer
  with no distribution (prompt lookup) proposes with certainty: q_i is a point mass on d_i.
"""
from __future__ import annotations

import torch

from nanoserve.sampling import SamplingParams


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def verify(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The tokens to emit and how many drafts were accepted.

    p: the target's distributions [k + 1, V]; drafts: the k proposed tokens; q: the draft's distributions
    [k, V], or None for a point mass on each draft. Emits the accepted drafts and one more token (the
    replacement of the first rejected draft, or the bonus), so between 1 and k + 1 tokens.
    """
    k = len(drafts)
    if params.greedy:
        target = p.argmax(-1).tolist()
        accepted = next((i for i in range(k) if drafts[i] != target[i]), k)
        return drafts[:accepted] + [target[accepted]], accepted
    for i, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_d < float(p[i, d]):             # u < p/q, without dividing by a q of 0
            continue
        residual = p[i].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:          # p == q: a rejection has probability 0; keep p
            residual = p[i]
        return drafts[:i] + [_draw(residual / residual.sum(), generator)], i
    return list(drafts) + [_draw(p[k], generator)], k
