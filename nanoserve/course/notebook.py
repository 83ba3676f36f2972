"""Helpers for the course notebooks.

`show(obj)` displays the source of a nanoserve function, class or module, so a chapter shows the
engine's real code instead of a pasted copy that could drift from it.
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


def show(obj) -> None:
    """Display `obj`'s source as a Markdown python code block, headed by its file.

    In a notebook this renders as highlighted code; elsewhere it prints the same text.
    """
    path, text = source(obj)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    title = f"`{path}`" + (f" · `{name}`" if not inspect.ismodule(obj) else "")
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
