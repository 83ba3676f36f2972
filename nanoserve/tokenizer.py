"""Text <-> token ids, through a model directory's `tokenizer.json` (the `tokenizers` library).

    tok = tokenizer.load(path)
    ids = tok.encode("def f(x):")      # list[int]; BOS added when the tokenizer's template says so
    tok.decode(ids)                    # str
    stream = tok.incremental_decoder() # for streaming: text only once its bytes form whole characters
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable."""


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file} is not valid JSON: {e}") from None


def _as_tuple(x) -> tuple[int, ...]:
    return () if x is None else tuple(x) if isinstance(x, (list, tuple)) else (x,)


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids   # generation stops at any of these (a model may have several)
        self.special_token_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Many texts at once; the Rust tokenizer spreads them over threads."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character.

    A byte-level BPE token can hold part of a character (an emoji spans several tokens); decoding
    such a prefix yields U+FFFD. We hold text back until it decodes cleanly. Decoding a short window
    of recent tokens, not just the new one, keeps the spacing decoders apply between tokens right.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0   # start of the window decoded for context
        self.read = 0     # tokens before this index have been emitted as text

    def push(self, token_ids) -> str:
        """Add tokens; return the text they complete (may be "" while a character is unfinished)."""
        self.ids.extend(int(t) for t in token_ids)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text still held back at the end of the stream (a broken character shows as U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


def load(path) -> Tokenizer:
    """The tokenizer of a model directory: tokenizer.json, with BOS/EOS from its configs."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"no tokenizer.json in {path}")
    try:
        tok = _HFTokenizer.from_file(str(file))
    except Exception as e:
        raise TokenizerError(f"cannot read {file}: {e}") from None
    root = file.parent
    model_cfg, gen_cfg, tok_cfg = (_read_json(root / n) for n in
                                   ("config.json", "generation_config.json", "tokenizer_config.json"))

    def token_id(value):
        if isinstance(value, dict):  # tokenizer_config may store {"content": "<s>", ...}
            value = value.get("content")
        return tok.token_to_id(value) if isinstance(value, str) else None

    # generation_config is what generation actually uses (it may list several stop ids); then config.json
    eos = _as_tuple(gen_cfg.get("eos_token_id")) or _as_tuple(model_cfg.get("eos_token_id")) \
        or _as_tuple(token_id(tok_cfg.get("eos_token")))
    bos = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
    if bos is None:
        bos = token_id(tok_cfg.get("bos_token"))
    return Tokenizer(tok, bos, tuple(e for e in eos if e is not None))
