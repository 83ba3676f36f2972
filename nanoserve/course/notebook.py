"""Helpers for the course notebooks.

`show(obj)` displays the source of a nanoserve function, class or module, so a chapter shows the
engine's real code instead of a pasted copy that could drift from it. `show(obj, hide={...})` shows
it trimmed to what a chapter has taught so far: the statements a later chapter adds are replaced by one
comment each that says what they do and where they are taught.
"""
from __future__ import annotations

import inspect
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]   # shown paths start at nanoserve/


def source(obj) -> tuple[str, str]:
    """(path relative to the repository, source text) of a function, class, method or module."""
    obj = inspect.unwrap(obj)
    try:
        text = inspect.getsource(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
    except (TypeError, OSError) as e:
        raise TypeError(f"show() needs a Python function, class or module with source on disk, got {obj!r}") from e
    try:
        path = path.relative_to(_REPO_ROOT)
    except ValueError:
        path = Path(path.name)  # outside nanoserve: never print an absolute path
    return path.as_posix(), text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def trim(text: str, hide: dict) -> str:
    """`text` (Python source) with some statements hidden, each run replaced by a comment `# ... note`.

    A key of `hide` is a marker, a substring that must occur in exactly one line: the statement that starts
    on that line and the block indented under it are hidden. Or a pair (first, last) of markers: the lines
    from first to last are hidden, and the block under last. Its value is the note (an empty note hides
    without a comment); hidden runs that touch and share a note get one comment. A marker that matches no
    line, or several, raises ValueError: a chapter notices when the code it trims has changed.
    """
    lines = text.splitlines()

    def find(marker: str) -> int:
        hits = [i for i, line in enumerate(lines) if marker in line]
        if len(hits) != 1:
            raise ValueError(f"hide marker {marker!r} must match exactly one line of the source, "
                             f"it matches {len(hits)}")
        return hits[0]

    def end_of_block(i: int) -> int:   # index just past line i and the lines indented under it
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(lines[i])):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():   # trailing blank lines stay
            j -= 1
        return j

    spans = []
    for key, note in hide.items():
        first, last = (key, key) if isinstance(key, str) else key
        a, b = find(first), find(last)
        if b < a:
            raise ValueError(f"hide range {key!r}: its last marker comes before its first")
        spans.append((a, end_of_block(b), note or ""))
    spans.sort()
    for (_, b, _), (a, _, _) in zip(spans, spans[1:]):
        if a < b:
            raise ValueError(f"hide markers overlap at line {a + 1}: {lines[a].strip()!r}")
    out, pos, last_note_end = [], 0, None
    for a, b, note in spans:
        out += lines[pos:a]
        comment = " " * _indent(lines[a]) + f"# ... {note}"
        if note and not (last_note_end == a and out and out[-1] == comment):
            out.append(comment)
        last_note_end, pos = b, b
    out += lines[pos:]
    return "\n".join(out)


def show(obj, hide: dict | None = None) -> None:
    """Display `obj`'s source as a Markdown python code block, headed by its file.

    `hide` trims it (see `trim`): {marker or (first, last): note}; the heading then says "trimmed".
    In a notebook this renders as highlighted code; elsewhere it prints the same text.
    """
    path, text = source(obj)
    if hide:
        text = trim(text, hide)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    title = f"`{path}`" + (f" · `{name}`" if not inspect.ismodule(obj) else "")
    if hide:
        title += " (trimmed to this chapter)"
    markdown = f"{title}\n\n```python\n{text.rstrip()}\n```"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(markdown))
    else:
        print(markdown)
