"""The data-quality job of lab 03: a corpus of small documents, the store it is read from, and the
per-document score (perplexity under the course model) used to filter it.

    path = dataset.make_corpus(folder, n_docs=2048, seed=0)   # JSONL, one {"id", "text"} per line
    store = dataset.DocumentStore(path, latency_s=1e-3)     # every request pays a round trip
    line = store.read(7); lines = store.read_many([7, 8, 9])
    nll = dataset.score_batch(model, input_ids, lengths)    # mean negative log-likelihood per document

The corpus is made here, deterministically, so nothing is downloaded: Python-like snippets (the course
model was trained on Python source, so they score well) mixed with the junk a crawl collects (random
characters, repeated words, encoded blobs), which a perplexity filter should drop.
"""
from __future__ import annotations

import json
import random
import string
import time
from pathlib import Path

import torch

_NAMES = ["data", "value", "result", "items", "count", "name", "path", "line", "text", "node", "key",
          "total", "index", "buffer", "config", "parser", "stream", "handler", "record", "token"]
_FUNCS = ["load", "parse", "read", "write", "update", "check", "build", "format", "split", "merge",
          "encode", "decode", "visit", "close", "reset", "flush", "copy", "find", "sort", "filter"]
_MODULES = ["os", "sys", "re", "json", "time", "math", "io", "collections", "itertools", "functools"]
_WORDS = ["the", "click", "here", "buy", "now", "free", "best", "price", "online", "shop", "deal"]


def _code(rng: random.Random) -> str:
    n, f, m = rng.choice(_NAMES), rng.choice(_FUNCS), rng.choice(_MODULES)
    a, b = rng.sample(_NAMES, 2)
    pieces = [
        f"import {m}\n",
        f"def {f}_{n}({a}, {b}):\n    return {a} + {b}\n",
        f"def {f}({n}):\n    if {n} is None:\n        return None\n    return {n}.{rng.choice(_FUNCS)}()\n",
        f"for {a} in {b}:\n    {n}.append({a})\n",
        f"class {f.capitalize()}{n.capitalize()}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
        f"{n} = {m}.{f}({a})\n",
        f"    {n} = {{}}\n    for {a} in range({rng.randint(2, 99)}):\n        {n}[{a}] = {b}\n",
        f"try:\n    {n} = {f}({a})\nexcept {rng.choice(['ValueError', 'KeyError', 'OSError'])}:\n    pass\n",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.choice([1, 1, 1, 2, 2, 3])))


def _junk(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return "".join(rng.choice(string.ascii_letters + string.digits + string.punctuation)
                       for _ in range(rng.randint(8, 80)))
    if kind == 1:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 30))).upper()
    return "".join(rng.choice(string.ascii_letters + string.digits + "+/") for _ in range(rng.randint(16, 90))) + "=="


def make_corpus(folder: str | Path, n_docs: int = 2048, seed: int = 0, junk_fraction: float = 0.3) -> Path:
    """Write `n_docs` documents to `folder`/corpus.jsonl, one JSON object {"id", "text"} per line.

    Same arguments, same bytes. About `junk_fraction` of the documents are junk, the rest code."""
    if n_docs < 1 or not 0 <= junk_fraction <= 1:
        raise ValueError(f"make_corpus needs n_docs >= 1 and 0 <= junk_fraction <= 1, "
                         f"got n_docs={n_docs}, junk_fraction={junk_fraction}")
    rng = random.Random(seed)
    path = Path(folder) / "corpus.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_docs):
            text = _junk(rng) if rng.random() < junk_fraction else _code(rng)
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


class DocumentStore:
    """A JSONL corpus served the way remote storage serves it: each request pays a round trip.

    A real corpus lives on an object store or a network filesystem, where a request costs a fixed
    latency (a fraction of a millisecond on a fast network filesystem, tens of milliseconds on an
    object store) however little it asks for. This machine has none, so this stand-in keeps the
    records in memory and sleeps `latency_s` per request. The wait uses no CPU, as a network wait would not.
    """

    def __init__(self, path: str | Path, latency_s: float = 1e-3):
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s}")
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no corpus at {path}: make one with dataset.make_corpus(folder)")
        self.lines = path.read_text(encoding="utf-8").splitlines()
        self.latency_s = latency_s

    def __len__(self) -> int:
        return len(self.lines)

    def sizes(self) -> list[int]:
        """Every record's size in bytes, as a listing of the store returns them (no request per record)."""
        return [len(line.encode("utf-8")) for line in self.lines]

    def read(self, index: int) -> str:
        """One record (a JSON line), for one request."""
        time.sleep(self.latency_s)
        return self.lines[index]

    def read_many(self, indices) -> list[str]:
        """Many records, for one request."""
        time.sleep(self.latency_s)
        return [self.lines[i] for i in indices]


@torch.inference_mode()
def score_batch(model, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood (nats per token) of each document under `model`.

    `input_ids` is [B, T], right-padded (pad values are ignored); `lengths` [B] counts each row's real
    tokens (at least 2: the first token is only context). Causal attention means the padding after a
    document cannot change its logits, so the score does not depend on how much padding it got.
    Returns a float32 tensor [B] on the model's device; exp() of it is the perplexity.
    """
    if input_ids.dim() != 2 or lengths.shape != input_ids.shape[:1]:
        raise ValueError(f"expected input_ids [B, T] and lengths [B], got {tuple(input_ids.shape)} "
                         f"and {tuple(lengths.shape)}")
    logits = model(input_ids)[:, :-1].float()
    targets = input_ids[:, 1:]
    # cross_entropy on flat [B*(T-1), vocab] rows: the class dimension contiguous is several times faster
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none").view(targets.shape)   # [B, T-1]
    mask = torch.arange(targets.shape[1], device=targets.device) < (lengths[:, None] - 1)
    return (nll * mask).sum(1) / mask.sum(1).clamp(min=1)
