"""The tokenizer: round trips, special tokens from the configs, and streaming text that never splits a character."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nanoserve import COURSE_MODEL, tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "naïve café — 東京 🐍🚀 Ω≈ç√", "x = '€' * 3  # ünïcödé"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small byte-level BPE whose vocabulary cannot hold whole CJK characters or emoji."""
    d = tmp_path_factory.mktemp("tok")
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(TEXTS * 20 + ["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    t.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok_dir, text):
    tok = tokenizer.load(tok_dir)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0       # the template adds BOS
    assert tok.decode(ids) == text               # and decode skips it
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.encode_batch([text, text]) == [ids, ids]


def test_eos_from_generation_config_first(tok_dir):
    tok = tokenizer.load(tok_dir)
    assert tok.eos_token_ids == (1, 0) and tok.eos_token_id == 1
    assert tok.special_token_ids == {0, 1}


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_never_emits_broken_characters(tok_dir, text):
    tok = tokenizer.load(tok_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) / 4  # multi-byte characters really are split over tokens
    stream = tok.incremental_decoder()
    pieces = [stream.push([i]) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoding_holds_back_a_partial_emoji(tok_dir):
    tok = tokenizer.load(tok_dir)
    ids = tok.encode("🐍", add_special_tokens=False)
    assert len(ids) > 1
    stream = tok.incremental_decoder()
    assert [stream.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) == "🐍"


def test_flush_shows_a_truncated_character(tok_dir):
    tok = tokenizer.load(tok_dir)
    ids = tok.encode("🐍", add_special_tokens=False)
    stream = tok.incremental_decoder()
    stream.push(ids[:1])
    assert stream.flush() == "\ufffd"


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(tokenizer.TokenizerError, match="no tokenizer.json"):
        tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(tokenizer.TokenizerError, match="cannot read"):
        tokenizer.load(tmp_path)
    with pytest.raises(TypeError, match="expects a str"):
        tokenizer.Tokenizer(Tokenizer(models.BPE()), None, ()).encode(123)


def test_course_model_tokenizer():
    tok = tokenizer.load(COURSE_MODEL)
    assert tok.vocab_size == 4096
    assert tok.eos_token_ids == (tok.special_token_ids and min(tok.special_token_ids),)
    code = "import os\n\ndef main():\n    print(os.getcwd())\n"
    assert tok.decode(tok.encode(code)) == code
    assert len(tok.encode(code)) < len(code) / 2.5  # BPE trained on Python compresses Python
