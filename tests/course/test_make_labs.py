"""tools/make_labs.py: solutions/ is the single source, labs/ is what the tool writes from it."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_NAME = "lab00_example.ipynb"


def _load_tool():
    spec = importlib.util.spec_from_file_location("make_labs", ROOT / "tools" / "make_labs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_labs = _load_tool()


def _generate(tmp_path: Path) -> Path:
    """Run the tool on the fixture solutions into a fresh labs folder; return that folder."""
    labs = tmp_path / "labs"
    assert make_labs.main(["--solutions", str(FIXTURES / "solutions"), "--labs", str(labs)]) == 0
    return labs


# --- regions in one cell -----------------------------------------------------------------------

def test_code_region_becomes_stub_with_hint_and_indentation():
    source = "\n".join([
        "def load(i):",
        "    ### BEGIN SOLUTION",
        "    # TODO: return batch i from the prefetch queue",
        "    # (a background thread fills it)",
        "    return queue.get()",
        "    ### END SOLUTION",
        "print('after')",
    ])
    out, n = make_labs.strip_solutions(source, "code")
    assert n == 1
    assert out.split("\n") == [
        "def load(i):",
        "    # TODO: return batch i from the prefetch queue",
        "    # (a background thread fills it)",
        '    raise NotImplementedError("TODO: return batch i from the prefetch queue (a background thread fills it)")',
        "print('after')",
    ]
    compile(out, "<lab cell>", "exec")  # the stub is valid Python


def test_plain_comment_hint_and_no_hint():
    out, _ = make_labs.strip_solutions("### BEGIN SOLUTION\n# measure it twice\nx = 1\n### END SOLUTION", "code")
    assert out == '# measure it twice\nraise NotImplementedError("TODO: measure it twice")'
    out, _ = make_labs.strip_solutions("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "code")
    assert out == 'raise NotImplementedError("TODO: complete this part")'


def test_hint_with_quotes_is_a_valid_literal():
    src = '### BEGIN SOLUTION\n# TODO: diagnosis = {"bound": ...}\nd = 1\n### END SOLUTION'
    out, _ = make_labs.strip_solutions(src, "code")
    with pytest.raises(NotImplementedError, match=r'TODO: diagnosis = \{"bound": \.\.\.\}'):
        exec(out, {})


def test_several_regions_in_one_cell():
    src = "a = 1\n### BEGIN SOLUTION\n# one\nb = 2\n### END SOLUTION\nc = 3\n### BEGIN SOLUTION\n# two\n### END SOLUTION"
    out, n = make_labs.strip_solutions(src, "code")
    assert n == 2
    assert "b = 2" not in out and out.count("raise NotImplementedError") == 2 and "c = 3" in out


def test_markdown_region_becomes_todo_line():
    src = "Why?\n\n### BEGIN SOLUTION\n<!-- TODO: name the bound -->\nIt waits on data.\n### END SOLUTION\n"
    out, n = make_labs.strip_solutions(src, "markdown")
    assert n == 1 and out == "Why?\n\n*TODO: name the bound*\n"
    out, _ = make_labs.strip_solutions("### BEGIN SOLUTION\nsecret\n### END SOLUTION", "markdown")
    assert out == "*TODO: write your answer here*"


@pytest.mark.parametrize("source", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",
    "## BEGIN SOLUTION\nx = 1\n## END SOLUTION",
    "### BEGIN SOLUTION: measure\nx = 1\n### END SOLUTION",
], ids=["never-closed", "end-without-begin", "nested", "near-miss-marker", "text-after-marker"])
def test_malformed_markers_are_errors(source):
    with pytest.raises(make_labs.MarkerError):
        make_labs.strip_solutions(source, "code")


def test_malformed_marker_names_file_and_cell(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1", id="c0")])
    sols = tmp_path / "solutions"
    sols.mkdir()
    nbformat.write(nb, str(sols / "lab01_bad.ipynb"))
    assert make_labs.main(["--solutions", str(sols), "--labs", str(tmp_path / "labs")]) == 2
    assert not (tmp_path / "labs" / "lab01_bad.ipynb").exists()


# --- whole notebooks, on the fixture --------------------------------------------------------------

def test_fixture_lab_is_what_the_tool_writes(tmp_path):
    labs = _generate(tmp_path)
    assert (labs / FIXTURE_NAME).read_bytes() == (FIXTURES / "labs" / FIXTURE_NAME).read_bytes()


def test_generated_lab_has_stubs_tags_and_no_outputs(tmp_path):
    labs = _generate(tmp_path)
    solution = nbformat.read(str(FIXTURES / "solutions" / FIXTURE_NAME), as_version=4)
    lab = nbformat.read(str(labs / FIXTURE_NAME), as_version=4)
    assert [c.cell_type for c in lab.cells] == [c.cell_type for c in solution.cells]
    text = (labs / FIXTURE_NAME).read_text(encoding="utf-8")
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    assert "ThreadPoolExecutor(workers)" not in text          # solution code is gone
    assert "# TODO: time load_batch and compute separately" in text   # hints are kept
    todo_cells = 0
    for sol, cell in zip(solution.cells, lab.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [] and cell.execution_count is None
        assert "execution" not in cell.metadata
        has_region = "### BEGIN SOLUTION" in sol.source
        assert ("raises-exception" in cell.metadata.get("tags", [])) == has_region
        assert ("raise NotImplementedError(" in cell.source) == has_region
        todo_cells += has_region
        if not has_region:
            assert cell.source == sol.source
    assert todo_cells == 3
    reflect = [c for c in lab.cells if c.cell_type == "markdown" and "*TODO:" in c.source]
    assert len(reflect) == 1 and "waiting in `load_batch`" not in reflect[0].source


def test_generation_is_idempotent_and_deterministic(tmp_path, capsys):
    labs = _generate(tmp_path)
    first = (labs / FIXTURE_NAME).read_bytes()
    capsys.readouterr()
    assert make_labs.main(["--solutions", str(FIXTURES / "solutions"), "--labs", str(labs)]) == 0
    assert capsys.readouterr().out == ""          # nothing to rewrite
    assert (labs / FIXTURE_NAME).read_bytes() == first
    other = _generate(tmp_path / "again")
    assert (other / FIXTURE_NAME).read_bytes() == first


def test_missing_cell_ids_are_filled_deterministically(tmp_path):
    raw = json.loads((FIXTURES / "solutions" / FIXTURE_NAME).read_text(encoding="utf-8"))
    for cell in raw["cells"]:
        del cell["id"]
    raw["nbformat_minor"] = 4
    a = make_labs.render(make_labs.make_lab(raw))
    b = make_labs.render(make_labs.make_lab(raw))
    assert a == b and '"id": "cell-0"' in a


# --- --check ------------------------------------------------------------------------------------

def _check(solutions: Path, labs: Path) -> int:
    return make_labs.main(["--check", "--solutions", str(solutions), "--labs", str(labs)])


def test_check_passes_on_the_fixture():
    assert _check(FIXTURES / "solutions", FIXTURES / "labs") == 0


def test_check_fails_on_a_hand_edited_lab(tmp_path, capsys):
    labs = tmp_path / "labs"
    shutil.copytree(FIXTURES / "labs", labs)
    lab = nbformat.read(str(labs / FIXTURE_NAME), as_version=4)
    lab.cells[1].source += "\n# a learner's note"
    nbformat.write(lab, str(labs / FIXTURE_NAME))
    assert _check(FIXTURES / "solutions", labs) == 1
    assert f"{FIXTURE_NAME}: differs" in capsys.readouterr().err


def test_check_fails_on_a_missing_lab(tmp_path, capsys):
    (tmp_path / "labs").mkdir()
    assert _check(FIXTURES / "solutions", tmp_path / "labs") == 1
    assert f"{FIXTURE_NAME}: missing" in capsys.readouterr().err


def test_check_fails_on_a_stale_lab_and_a_run_deletes_it(tmp_path, capsys):
    labs = tmp_path / "labs"
    shutil.copytree(FIXTURES / "labs", labs)
    shutil.copy(labs / FIXTURE_NAME, labs / "lab99_gone.ipynb")
    assert _check(FIXTURES / "solutions", labs) == 1
    assert "lab99_gone.ipynb: stale" in capsys.readouterr().err
    assert make_labs.main(["--solutions", str(FIXTURES / "solutions"), "--labs", str(labs)]) == 0
    assert not (labs / "lab99_gone.ipynb").exists() and (labs / FIXTURE_NAME).exists()


def test_command_line_check_exit_status(tmp_path):
    """The way `make labs` and CI call it: as a script."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "make_labs.py"), "--check",
                           "--solutions", str(FIXTURES / "solutions"), "--labs", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and f"{FIXTURE_NAME}: missing" in done.stderr, done.stderr


# --- the repository itself --------------------------------------------------------------------------

def test_repo_labs_are_in_sync_with_solutions(capsys):
    """labs/ must be exactly what `make labs` writes from solutions/ (and hold no lab without a solution).

    With no labs yet this compares nothing; it starts biting with the first solutions/labNN_*.ipynb.
    """
    status = make_labs.main(["--check"])
    report = capsys.readouterr()
    n_solutions = sum(len(list((ROOT / "solutions").glob(g))) for g in make_labs.LAB_GLOBS)
    assert status == 0, f"labs/ is out of date; run `make labs`:\n{report.err}"
    assert f"({n_solutions} checked)" in report.out


def test_hint_wrapped_over_lines_is_never_cut_mid_sentence():
    src = ("### BEGIN SOLUTION\n# TODO: profile the slow step, keep it as prof_slow and\n"
           "# read its breakdown\n#\n# (a second paragraph stays a comment only)\nx = 1\n### END SOLUTION")
    out, _ = make_labs.strip_solutions(src, "code")
    assert out.endswith('raise NotImplementedError("TODO: profile the slow step, keep it as prof_slow and read its breakdown")')
    assert "# (a second paragraph stays a comment only)" in out
