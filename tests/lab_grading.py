"""Shared by the lab grader tests: a lab as generated must fail, its solution must pass every check."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from nanoserve import grade

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
    done = subprocess.run([sys.executable, "-m", "nanoserve.grade", str(solution)],
                          capture_output=True, text=True, cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for name in checks:
        assert re.search(rf"PASS\s+{name}\s", out), out
    assert f"{len(checks)} passed, 0 failed" in out
    return out
