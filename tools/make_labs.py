"""Write labs/ from solutions/: the learner's copy of each lab and exercise notebook, solutions cut out.

    python tools/make_labs.py                 # (re)write labs/labNN_*.ipynb and labs/exNN_*.ipynb   (`make labs`)
    python tools/make_labs.py --check         # exit 1, listing the files, if labs/ is out of date
    python tools/make_labs.py --solutions DIR --labs DIR     # other folders (the tests use a fixture)

solutions/labNN_slug.ipynb is the single source of a lab; labs/labNN_slug.ipynb is generated from it
and never edited by hand. Exercise notebooks (solutions/exNN_slug.ipynb, one per chapter) are generated
the same way; their solution regions usually sit inside a function's body, so the learner's copy defines
the function and calling it raises the TODO (the exercise's check reports that as a FAIL).

Code cells. A solution region is the lines strictly between a line `### BEGIN SOLUTION` and a line
`### END SOLUTION` (each marker alone on its line, at any indentation). The region becomes a stub:
  - its hint, the comment lines at the start of the region (up to its first line of code), is kept
    as written, at its own indentation, so the learner sees what to do;
  - then `raise NotImplementedError("TODO: <hint>")` at the indentation of the BEGIN marker, where
    <hint> is the hint's first paragraph (its comment lines up to a blank one, joined) without the
    `#`s and without a leading `TODO:`
    ("complete this part" when the region has no hint).
For example

        ### BEGIN SOLUTION
        # TODO: time the data step and the compute step separately
        # (seconds, summed over all steps)
        measured = {"data": ..., "compute": ...}
        ### END SOLUTION

becomes

        # TODO: time the data step and the compute step separately
        # (seconds, summed over all steps)
        raise NotImplementedError("TODO: time the data step and the compute step separately (seconds, summed over all steps)")

and the cell is tagged `raises-exception` (nbval and nbclient then expect its error; the grader,
`python -m nanoserve.course.grade`, counts it as a failed "not implemented" check).

Markdown cells (a written diagnosis, a reflection) use the same markers. The hint is an HTML comment
line `<!-- ... -->` at the start of the region, invisible in the rendered solution; the region becomes
one line `*TODO: <hint>*` ("*TODO: write your answer here*" without a hint), and no raise.

Every cell of a lab has its outputs, execution count and execution timing cleared, so a learner
starts clean. The notebook is written by nbformat (sorted keys, one-space indent, final newline);
cells without an id get one from their position. Same solutions, same bytes.

A marker-like line that is not exactly a marker ("## BEGIN SOLUTIONS", text after it), a BEGIN
without END, or an END without BEGIN is an error (exit 2): a typo must not leak a solution.
A lab with no solution is stale: `--check` reports it and a normal run deletes it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
TODO_TAG = "raises-exception"
LAB_GLOBS = ("lab*.ipynb", "ex[0-9]*.ipynb")
DEFAULT_CODE_HINT = "complete this part"
DEFAULT_MARKDOWN_HINT = "write your answer here"

_MARKER_LIKE = re.compile(r"#+\s*(BEGIN|END)\s+SOLUTION", re.IGNORECASE)
_HTML_COMMENT = re.compile(r"^\s*<!--(.*?)-->\s*$")


class MarkerError(ValueError):
    """A solution notebook's BEGIN/END SOLUTION markers are malformed."""


def _hint_text(text: str) -> str:
    """One hint line's text, without a leading 'TODO:' (the stub adds its own)."""
    text = text.strip()
    return re.sub(r"^TODO\s*:?\s*", "", text, flags=re.IGNORECASE).strip()


def _regions(lines: list[str]):
    """Yield (begin_index, end_index) of each solution region's marker lines; raise MarkerError if malformed."""
    begin = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped == BEGIN:
            if begin is not None:
                raise MarkerError(f"line {i + 1}: {BEGIN!r} inside a region opened at line {begin + 1}")
            begin = i
        elif stripped == END:
            if begin is None:
                raise MarkerError(f"line {i + 1}: {END!r} without a {BEGIN!r} before it")
            yield begin, i
            begin = None
        elif _MARKER_LIKE.search(stripped):
            raise MarkerError(f"line {i + 1}: {stripped!r} looks like a marker but is not exactly "
                              f"{BEGIN!r} or {END!r}")
    if begin is not None:
        raise MarkerError(f"line {begin + 1}: {BEGIN!r} is never closed by {END!r}")


def _py_string(text: str) -> str:
    """A Python string literal for `text`, in double quotes unless the text has some."""
    return json.dumps(text, ensure_ascii=False) if '"' not in text else repr(text)


def _code_stub(indent: str, body: list[str]) -> list[str]:
    hint_lines = []
    for line in body:
        if line.strip() and not line.strip().startswith("#"):
            break
        hint_lines.append(line)
    while hint_lines and not hint_lines[-1].strip():
        hint_lines.pop()
    # The stub's message is the hint's whole first paragraph (consecutive comment lines), so a hint
    # wrapped over several lines is never cut mid-sentence.
    paragraph: list[str] = []
    for line in hint_lines:
        text = _hint_text(line.strip().lstrip("#")) if not paragraph else line.strip().lstrip("#").strip()
        if text:
            paragraph.append(text)
        elif paragraph:
            break
    hint = " ".join(paragraph) or DEFAULT_CODE_HINT
    return hint_lines + [f"{indent}raise NotImplementedError({_py_string('TODO: ' + hint)})"]


def _markdown_stub(indent: str, body: list[str]) -> list[str]:
    texts = []
    for line in body:
        if not line.strip():
            continue
        m = _HTML_COMMENT.match(line)
        if m is None:
            break
        texts.append(_hint_text(m.group(1)))
    hint = next((t for t in texts if t), DEFAULT_MARKDOWN_HINT)
    return [f"{indent}*TODO: {hint}*"]


def strip_solutions(source: str, cell_type: str) -> tuple[str, int]:
    """`source` with every solution region replaced by its stub, and the number of regions."""
    lines = source.split("\n")
    out, last, count = [], 0, 0
    for begin, end in list(_regions(lines)):
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        stub = _code_stub if cell_type == "code" else _markdown_stub
        out += lines[last:begin] + stub(indent, lines[begin + 1:end])
        last, count = end + 1, count + 1
    out += lines[last:]
    return "\n".join(out), count


def make_lab(solution: dict, name: str = "notebook") -> nbformat.NotebookNode:
    """The lab notebook for a solution notebook given as parsed JSON (a dict)."""
    if solution.get("nbformat") != 4:
        raise MarkerError(f"{name}: expected an nbformat 4 notebook, got nbformat {solution.get('nbformat')}")
    nb = json.loads(json.dumps(solution))  # a deep copy we may change
    nb["nbformat_minor"] = max(int(nb.get("nbformat_minor", 0)), 5)
    for i, cell in enumerate(nb["cells"]):
        cell.setdefault("id", f"cell-{i}")
        cell.setdefault("metadata", {}).pop("execution", None)
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        try:
            source, regions = strip_solutions(source, cell["cell_type"])
        except MarkerError as exc:
            raise MarkerError(f"{name}, cell {i} ({cell['cell_type']}): {exc}") from None
        cell["source"] = source
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            if regions:
                tags = cell["metadata"].setdefault("tags", [])
                if TODO_TAG not in tags:
                    tags.append(TODO_TAG)
    return nbformat.from_dict(nb)


def render(nb: nbformat.NotebookNode) -> str:
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def expected_labs(solutions_dir: Path) -> dict[str, str]:
    """File name -> the text tools/make_labs.py writes for it, for every solution in `solutions_dir`."""
    labs = {}
    for path in sorted(p for pattern in LAB_GLOBS for p in solutions_dir.glob(pattern)):
        with open(path, encoding="utf-8") as f:
            labs[path.name] = render(make_lab(json.load(f), name=str(path)))
    return labs


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write labs/ from solutions/ (see the module docstring).")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 listing every lab that is missing, differs or is stale")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions", help="folder of solution notebooks")
    parser.add_argument("--labs", type=Path, default=ROOT / "labs", help="folder of generated labs")
    args = parser.parse_args(argv)
    if not args.solutions.is_dir():
        parser.error(f"solutions folder {args.solutions} does not exist")
    try:
        expected = expected_labs(args.solutions)
    except (MarkerError, json.JSONDecodeError) as exc:
        print(f"make_labs: {exc}", file=sys.stderr)
        return 2
    existing = {p.name for pattern in LAB_GLOBS for p in args.labs.glob(pattern)} if args.labs.is_dir() else set()
    problems = []
    for name, text in expected.items():
        lab = args.labs / name
        current = lab.read_bytes() if lab.is_file() else None
        if current == text.encode("utf-8"):
            continue
        if args.check:
            why = "missing" if current is None else f"differs from what {_rel(args.solutions / name)} generates"
            problems.append(f"{_rel(lab)}: {why}")
        else:
            args.labs.mkdir(parents=True, exist_ok=True)
            lab.write_bytes(text.encode("utf-8"))
            print(f"wrote {_rel(lab)}")
    for name in sorted(existing - set(expected)):
        lab = args.labs / name
        if args.check:
            problems.append(f"{_rel(lab)}: stale, there is no {_rel(args.solutions / name)}")
        else:
            lab.unlink()
            print(f"deleted {_rel(lab)} (no solution for it)")
    if problems:
        print("labs/ is out of date with solutions/ (run `make labs`):", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    if args.check:
        print(f"labs up to date ({len(expected)} checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
