"""Shared by the lab grader tests: a lab as generated must fail, its solution must pass every check."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from nanoserve.course import grade

ROOT = Path(__file__).resolve().parent.parent


def assert_unsolved_fails(lab: Path, tmp_path: Path, capsys, must_not_pass: tuple[str, ...], todos: int = 3) -> str:
    """Grade a learner's untouched copy (wherever it lives): non-zero exit, `todos` stubs, none of `must_not_pass`."""
    copy = tmp_path / lab.name
    shutil.copy(lab, copy)
    assert grade.main([str(copy)]) == 1
    out = capsys.readouterr().out
    assert out.count("not implemented: NotImplementedError: TODO:") == todos, out
    assert not re.search(rf"PASS\s+({'|'.join(must_not_pass)})\s", out), out
    return out


def assert_solution_passes(solution: Path, checks: tuple[str, ...]) -> str:
    """Grade the solution through the command line, as an instructor runs it: every check passes."""
    done = subprocess.run([sys.executable, "-m", "nanoserve.course.grade", str(solution)],
                          capture_output=True, text=True, cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for name in checks:
        assert re.search(rf"PASS\s+{name}\s", out), out
    assert f"{len(checks)} passed, 0 failed" in out
    return out


def grade_edited_solution(solution: Path, edits: list[tuple[str, str]], tmp_path: Path, capsys) -> tuple[int, str]:
    """Grade a copy of the solution with each `old` text (found in exactly one cell) replaced by `new`:
    a learner who got one step wrong. Returns the grader's exit code and what it printed."""
    nb = nbformat.read(str(solution), as_version=4)
    for old, new in edits:
        cells = [c for c in nb.cells if old in c.source]
        assert len(cells) == 1, f"expected one cell of {solution.name} to contain {old!r}, found {len(cells)}"
        cells[0].source = cells[0].source.replace(old, new)
    path = tmp_path / solution.name
    nbformat.write(nb, str(path))
    code = grade.main([str(path)])
    return code, capsys.readouterr().out
