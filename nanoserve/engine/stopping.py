"""Chapter 03: when a request is done, and why. Every rule in one place.

- **a stop token**: one of the model's end-of-sequence tokens (unless the request set `ignore_eos`) or one of
  the request's `stop_token_ids` (those count even with `ignore_eos`: the request asked for them);
- **its length**: `max_tokens` generated, or the model's window (`max_model_len`) full;
- **a stop string**: one of the request's `stop` strings in the text decoded so far; the text ends before it.

Before `min_tokens` are out no stop token can end a request (the sampler bans them: `stop_token_ids` names
which) and no stop string is looked for.

Tokens and length are decided for each token as the scheduler records it, so a finished sequence gives its
KV blocks back in the same step; a stop string once the engine has decoded the token's text. A stop token is
checked before the length (a stop token that is also the last allowed one is a stop), and a stop string wins
over the length of the token that completed it. Either sets `seq.stop_reason`, the token or string itself.
"""
from __future__ import annotations

from nanoserve.engine.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def stop_token_ids(self, params) -> set[int]:
        """The tokens that end a request with these SamplingParams."""
        return (set() if params.ignore_eos else set(self.eos_token_ids)) | set(params.stop_token_ids or ())

    def check_token(self, seq: Sequence, token: int) -> str | None:
        """Right after `token` was appended to `seq`: "stop", "length", or None to go on."""
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or (p.stop_token_ids and token in p.stop_token_ids):
            seq.stop_reason = token
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def check_text(seq: Sequence) -> str | None:
        """After new text was decoded into `seq.text`: the stop string that ends it first, with `seq.text` cut
        before it, or None. Only text that could hold a new match is searched (a match may start in the text
        held back, never in what was sent)."""
        stops = seq.params.stop or ()
        if not stops or len(seq.output_token_ids) < seq.params.min_tokens:
            return None
        search_from = max(0, seq.num_text_sent - max(map(len, stops)) + 1)
        found = [(i, s) for s in stops if (i := seq.text.find(s, search_from)) >= 0]
        if not found:
            return None
        cut, stop = min(found)
        seq.text = seq.text[:cut]
        return stop

    @staticmethod
    def held_back(seq: Sequence) -> int:
        """Characters at the end of `seq.text` not to send yet: they may be the start of a stop string."""
        stops = seq.params.stop or ()
        return 0 if seq.is_finished or not stops else max(map(len, stops)) - 1
