"""nanoserve.course.dataset: the corpus is deterministic, the store charges per request, and a document's
score does not depend on how much padding it got."""
from __future__ import annotations

import json
import time

import pytest
import torch

from nanoserve import COURSE_DRAFT_MODEL, models, tokenizer
from nanoserve.course import dataset


def test_make_corpus_is_deterministic_and_mixed(tmp_path):
    a = dataset.make_corpus(tmp_path / "a", n_docs=200, seed=3).read_bytes()
    b = dataset.make_corpus(tmp_path / "b", n_docs=200, seed=3).read_bytes()
    c = dataset.make_corpus(tmp_path / "c", n_docs=200, seed=4).read_bytes()
    assert a == b and a != c
    records = [json.loads(line) for line in a.decode().splitlines()]
    assert [r["id"] for r in records] == list(range(200))
    code = sum("def " in r["text"] or "import " in r["text"] or "=" in r["text"] for r in records)
    assert 0.4 * 200 < code < 200   # mostly code, some junk
    with pytest.raises(ValueError, match="n_docs"):
        dataset.make_corpus(tmp_path, n_docs=0)


def test_store_charges_one_latency_per_request(tmp_path):
    store = dataset.DocumentStore(dataset.make_corpus(tmp_path, n_docs=20), latency_s=0.005)
    start = time.perf_counter()
    one_by_one = [store.read(i) for i in range(20)]
    per_record_s = time.perf_counter() - start
    start = time.perf_counter()
    together = store.read_many(range(20))
    one_request_s = time.perf_counter() - start
    assert one_by_one == together == store.lines
    assert per_record_s >= 20 * 0.005 and one_request_s < per_record_s / 4
    assert store.sizes() == [len(line.encode()) for line in store.lines]
    with pytest.raises(FileNotFoundError, match="make_corpus"):
        dataset.DocumentStore(tmp_path / "missing.jsonl")


def test_score_ignores_padding_and_matches_a_direct_computation():
    torch.set_num_threads(1)
    model = models.load(COURSE_DRAFT_MODEL, device="cpu", dtype=torch.float32).eval()
    tok = tokenizer.load(COURSE_DRAFT_MODEL)
    ids = tok.encode("def parse(value):\n    return value\n")[:12]
    n = len(ids)
    alone = dataset.score_batch(model, torch.tensor([ids]), torch.tensor([n]))
    padded = dataset.score_batch(model, torch.tensor([ids + [7] * 9, ids[:5] + [0] * (n + 4)]),
                                 torch.tensor([n, 5]))
    assert torch.allclose(padded[0], alone[0], atol=1e-5)
    with torch.inference_mode():
        logp = model(torch.tensor([ids])).log_softmax(-1)[0]
    direct = -torch.stack([logp[t, ids[t + 1]] for t in range(n - 1)]).mean()
    assert alone[0].item() == pytest.approx(direct.item(), abs=1e-5)
    with pytest.raises(ValueError, match="lengths"):
        dataset.score_batch(model, torch.tensor([ids]), torch.tensor([n, n]))
