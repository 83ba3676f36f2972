"""The course's own lm-eval tasks, written from the held-out corpus, and our offline engine's scoring of them.

Two tasks over lines of the held-out standard-library files (the course model never trained on them):

- `course_line_mc` (multiple choice, lm-eval's `acc`): a few lines of code, then the true next line against three
  lines of the same indentation and about the same length drawn from elsewhere in the held-out text; the choice
  with the highest summed log-probability wins (lengths matched, because a sum favours short lines).
- `course_line_gen` (generate until "\\n", `exact_match`): more lines of context and the next line up to its last
  word, which the model must write exactly (a word of at most 10 characters: this small model writes about one in five).

    python -m nanoserve.course.evals          # writes benchmarks/lm_eval/*.jsonl (a test checks they match)
    scores = score_offline(LLM(), read_items())

Items are drawn with a fixed seed, so the shipped files are what the command writes on any machine with the same
standard library. `score_offline` scores them the way lm-eval's `local-completions` model does over our server
(the same token split of context and continuation), so the two can be compared item by item.
"""
from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from nanoserve.course.corpus import corpus_files, read

TASK_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval"
MC_TASK, GEN_TASK = "course_line_mc", "course_line_gen"
MC_CONTEXT_LINES = 4    # x 4 choices, each scored over its context: the bulk of a run's tokens
GEN_CONTEXT_LINES = 8
MAX_LAST_WORD = 10      # characters of a generate-until target, its leading space included
NUM_ITEMS = 48          # per task: each run is seconds; a binomial standard error of about 7 points at 50%
NUM_CHOICES = 4
LENGTH_MATCH = 0.2      # a distractor's length is within 20% of the true line's
MAX_GEN_TOKENS = 32     # the YAML's max_gen_toks: every target line fits in far fewer
SEED = 0
LL_TOLERANCE = 1e-3     # nats: a choice's summed log-probability, server against offline, both fp32
TIE_NATS = 1e-3         # two choices (or tokens) closer than this may swap between two fp32 runs batched differently


@dataclass(frozen=True)
class Line:
    """A held-out line that can be a target, with the lines before it."""
    source: str      # "path/in/stdlib.py:line number"
    context: str     # the lines before it, each ending in "\n"
    text: str        # the line itself, without its newline

    @property
    def indent(self) -> str:
        return self.text[:len(self.text) - len(self.text.lstrip(" "))]


def heldout_lines(context_lines: int) -> list[Line]:
    """Every candidate target line of the held-out files, in path and line order, with its `context_lines` lines
    before it: ASCII code lines of 12 to 60 characters (not comments, not rows of an aligned table) with a space
    after their first word, and a context that is not blank."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in corpus_files()[1]:
        rel = f.relative_to(root).as_posix()
        if rel.startswith("encodings/"):   # generated codec tables: rows of hex, not code anyone writes
            continue
        lines = read(f).split("\n")
        for i in range(context_lines, len(lines) - 1):
            text, context = lines[i], "".join(s + "\n" for s in lines[i - context_lines:i])
            body = text.strip()
            if not (12 <= len(body) <= 60) or body.startswith("#") or " " not in body or not context.strip():
                continue
            if "  " in body:   # aligned columns: rows of a data table (locale's aliases), or a trailing comment
                continue
            if not (text + context).isascii() or any(c in text + context for c in "\t\r\x0c"):
                continue
            out.append(Line(f"{rel}:{i + 1}", context, text))
    return out


def mc_items(lines: list[Line], n: int = NUM_ITEMS, seed: int = SEED) -> list[dict]:
    """n multiple-choice items: the true line and NUM_CHOICES - 1 distinct lines of the same indentation and a
    length within LENGTH_MATCH of its own, shuffled."""
    rng = random.Random(seed)
    same_indent: dict[str, dict[str, None]] = {}
    for line in lines:   # distinct texts in corpus order (dict keys: deterministic, unlike a set)
        same_indent.setdefault(line.indent, {})[line.text] = None
    items = []
    for line in rng.sample(lines, len(lines)):
        pool = [t for t in same_indent[line.indent]
                if t != line.text and abs(len(t) - len(line.text)) <= LENGTH_MATCH * len(line.text)]
        if len(pool) < NUM_CHOICES - 1:
            continue
        choices = [line.text] + rng.sample(pool, NUM_CHOICES - 1)
        rng.shuffle(choices)
        items.append(dict(source=line.source, context=line.context, choices=choices, gold=choices.index(line.text)))
        if len(items) == n:
            return items
    raise ValueError(f"only {len(items)} multiple-choice items from {len(lines)} held-out lines, {n} asked")


def gen_items(lines: list[Line], n: int = NUM_ITEMS, seed: int = SEED + 1) -> list[dict]:
    """n generate-until items: the context runs up to the line's last word; the target is that word, with the
    space before it (lm-eval compares texts exactly), at most MAX_LAST_WORD characters."""
    short = [line for line in lines if len(line.text) - line.text.rindex(" ") <= MAX_LAST_WORD]
    items = []
    for line in random.Random(seed).sample(short, n):
        cut = line.text.rindex(" ")
        items.append(dict(source=line.source, context=line.context + line.text[:cut], target=line.text[cut:]))
    return items


def make_items() -> dict[str, list[dict]]:
    return {MC_TASK: mc_items(heldout_lines(MC_CONTEXT_LINES)), GEN_TASK: gen_items(heldout_lines(GEN_CONTEXT_LINES))}


def items_file(task: str, task_dir: Path = TASK_DIR) -> Path:
    return task_dir / f"{task}.jsonl"


def write_items(task_dir: Path = TASK_DIR) -> dict[str, list[dict]]:
    items = make_items()
    for task, rows in items.items():
        items_file(task, task_dir).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return items


def read_items(task_dir: Path = TASK_DIR) -> dict[str, list[dict]]:
    """The shipped items of both tasks, as the YAMLs give them to lm-eval."""
    return {task: [json.loads(s) for s in items_file(task, task_dir).read_text().splitlines()]
            for task in (MC_TASK, GEN_TASK)}


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) into token ids: trailing whitespace of the context moves to the
    continuation, the whole text is encoded at once, and the continuation is what follows the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def score_offline(llm, items: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each item scored by the offline engine `llm` (a nanoserve.LLM) as lm-eval scores it over the server.
    Multiple choice: every choice's summed log-probability (`loglikelihoods`), `acc` (1.0 if the argmax is the gold
    choice, the first of equals winning, as numpy's argmax) and `margin`, the best choice's lead over the next.
    Generate-until: the greedy text up to "\\n" or MAX_GEN_TOKENS (`text`), `exact_match`, and `margin`, the
    smallest lead of the chosen token over the runner-up at any step (nats)."""
    from nanoserve import SamplingParams
    tok = llm.tokenizer
    pairs = [encode_pair(tok, it["context"], c) for it in items[MC_TASK] for c in it["choices"]]
    outs = llm.generate([c + x for c, x in pairs], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    lls = iter(sum(e[t].logprob for t, e in zip(x, out.prompt_logprobs[len(c):]))
               for (c, x), out in zip(pairs, outs))
    mc = []
    for it in items[MC_TASK]:
        ll = [next(lls) for _ in it["choices"]]
        best, second = sorted(ll, reverse=True)[:2]
        mc.append(dict(loglikelihoods=ll, acc=float(ll.index(best) == it["gold"]), margin=best - second))
    prompts = [tok.encode(it["context"], add_special_tokens=False) for it in items[GEN_TASK]]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_GEN_TOKENS, stop=["\n"], logprobs=2)
    gen = []
    for out, it in zip(llm.generate(prompts, greedy, use_tqdm=False), items[GEN_TASK]):
        text = out.outputs[0].text
        margin = min(top_two_gap(e) for e in out.outputs[0].logprobs)
        gen.append(dict(text=text, exact_match=float(text == it["target"]), margin=margin))
    return {MC_TASK: mc, GEN_TASK: gen}


def top_two_gap(entries: dict) -> float:
    """How far the most likely token of one position leads the second (nats)."""
    ranked = sorted(e.logprob for e in entries.values())
    return ranked[-1] - ranked[-2]


def accuracy(scores: dict[str, list[dict]]) -> dict[str, float]:
    """{task: the mean of its metric over items}: acc for multiple choice, exact_match for generate-until."""
    return {MC_TASK: sum(s["acc"] for s in scores[MC_TASK]) / len(scores[MC_TASK]),
            GEN_TASK: sum(s["exact_match"] for s in scores[GEN_TASK]) / len(scores[GEN_TASK])}


def disagreements(lm_eval: dict[str, list[dict]], offline: dict[str, list[dict]]) -> list[str]:
    """Where lm-eval's per-item scores (`lmeval.LmEvalRun.samples`) and the offline engine's differ by more than
    fp32 arithmetic can: a choice's log-likelihood off by more than LL_TOLERANCE, or a different verdict or text on
    an item with no near-tie (a lead of at least TIE_NATS). The server batches requests differently from the
    offline engine, which changes the order of floating-point sums by a last bit or so; that can swap two choices
    (or two tokens) only when they are that close."""
    found = []
    for i, (theirs, ours) in enumerate(zip(lm_eval[MC_TASK], offline[MC_TASK], strict=True)):
        worst = max(abs(a - b) for a, b in zip(theirs["loglikelihoods"], ours["loglikelihoods"], strict=True))
        if worst > LL_TOLERANCE:
            found.append(f"{MC_TASK}[{i}]: a choice's log-likelihood differs by {worst:.2e}")
        if theirs["acc"] != ours["acc"] and ours["margin"] >= TIE_NATS:
            found.append(f"{MC_TASK}[{i}]: acc {theirs['acc']} against {ours['acc']} offline "
                         f"(lead {ours['margin']:.2e})")
    for i, (theirs, ours) in enumerate(zip(lm_eval[GEN_TASK], offline[GEN_TASK], strict=True)):
        if theirs["text"] != ours["text"] and ours["margin"] >= TIE_NATS:
            found.append(f"{GEN_TASK}[{i}]: {theirs['text']!r} against {ours['text']!r} offline")
    return found


if __name__ == "__main__":
    written = write_items()
    print(", ".join(f"{len(rows)} items in {items_file(task)}" for task, rows in written.items()))
