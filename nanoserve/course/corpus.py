"""The course models' corpus: the Python standard library's own .py files, on every machine, offline.

Files are split into train and validation by a hash of their path, so the split is the same
everywhere (`tools/train_course_model.py` trains on one side; chapter 07 scores on the other).
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

MAX_FILE_BYTES = 200_000  # skip generated tables (unicode data, pydoc topics): not code anyone writes


def corpus_files(limit: int | None = None) -> tuple[list[Path], list[Path]]:
    """(train, validation) .py files of the standard library; tests and generated tables left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in f"/{rel}" or f.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(f)
    if limit:
        files = files[:limit]
    # the same split on every machine: 1 file in 40 (by a hash of its path) is held out for validation
    is_val = [int(hashlib.sha1(f.relative_to(root).as_posix().encode()).hexdigest(), 16) % 40 == 0 for f in files]
    return [f for f, v in zip(files, is_val) if not v], [f for f, v in zip(files, is_val) if v]


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def heldout_text(max_bytes: int | None = None) -> str:
    """The validation files' text, joined in path order, cut to `max_bytes` characters if given."""
    _, val = corpus_files()
    if not val:
        raise FileNotFoundError(f"no held-out .py files under {sysconfig.get_paths()['stdlib']}: is the standard "
                                "library's source installed (some slim images ship only .pyc)?")
    text = "".join(read(f) for f in val)
    return text if max_bytes is None else text[:max_bytes]
