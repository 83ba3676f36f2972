"""Grading a class (nanoserve.course.grade.grade_folder): a folder of submissions, one sub-folder per learner, where some
submissions are broken; every one becomes a row that says what happened, and the batch never stops."""
from __future__ import annotations

import csv
from pathlib import Path

import nbformat

from nanoserve.course import grade

NAME = "lab03_data_pipeline.ipynb"


def notebook(*sources, todo: int | None = None):
    """A small lab: code cells printing check lines as nanoserve.course.grading does (no torch to import, so each
    kernel starts quickly); cell `todo` is a TODO stub, tagged as tools/make_labs.py tags one."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab")] + [nbformat.v4.new_code_cell(s) for s in sources]
    if todo is not None:
        nb.cells[todo].metadata["tags"] = [grade.TODO_TAG]
    return nb


def write(path: Path, nb) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def test_a_class_with_broken_submissions_is_graded_row_by_row(tmp_path):
    root = tmp_path / "submissions"
    checks = ['print("PASS measured: 3 rows")', 'print("PASS diagnosis: bound=data")']
    write(root / "ada" / NAME, notebook(*checks))                                     # solved
    write(root / "bob" / NAME, notebook('raise NotImplementedError("TODO: measure")', 'print("FAIL diagnosis: none")',
                                        todo=1))                                      # handed in untouched
    (root / "carol").mkdir()
    (root / "carol" / NAME).write_text("this is not a notebook")                      # not JSON
    (root / "dan").mkdir()
    (root / "dan" / NAME).write_text("")                                              # empty
    write(root / "eve" / NAME, notebook("x = 1"))                                     # the check cells deleted
    looping = notebook("while True:\n    pass", *checks)                              # loops forever
    write(root / "finn" / "week2" / NAME, looping)                                    # at any depth
    write(root / "finn" / ".ipynb_checkpoints" / NAME, looping)                       # Jupyter's copy: skipped

    rows = grade.grade_folder(root, timeout=3, progress=lambda line: None)
    by = {row.learner: row for row in rows}
    assert [(r.learner, r.notebook) for r in rows] == [(who, NAME) for who in ("ada", "bob", "carol", "dan", "eve", "finn")]
    assert by["ada"].passed and by["ada"].checks == {"measured": True, "diagnosis": True}
    assert not by["bob"].passed and by["bob"].checks == {"cell 1 (TODO)": False, "diagnosis": False}
    for who in ("carol", "dan"):
        assert not by[who].passed and by[who].problem.startswith("cannot be read as a notebook"), by[who].problem
    assert not by["eve"].passed and by["eve"].problem.startswith("no check ran")
    finn = by["finn"]                                                                 # the loop interrupted at the
    assert not finn.passed and not finn.problem                                       # cell limit, then the rest ran
    assert finn.checks == {"cell 1": False, "measured": True, "diagnosis": True}

    table = tmp_path / "grades.csv"
    grade.write_csv(rows, table)
    with open(table) as f:
        read = list(csv.DictReader(f))
    assert [r["learner"] for r in read] == ["ada", "bob", "carol", "dan", "eve", "finn"]
    assert [r["result"] for r in read] == ["PASS"] + ["FAIL"] * 5
    assert read[0]["measured"] == "PASS" and read[1]["diagnosis"] == "FAIL" and read[2]["measured"] == ""
    assert read[2]["problem"] and read[5]["cell 1"] == "FAIL"
    text = grade.summary(rows)
    assert text.splitlines()[1].split()[:3] == [NAME, "6", "1"] and "diagnosis (1)" in text   # 6 handed in, 1 passed


def test_the_command_line_grades_a_folder_and_writes_the_table(tmp_path, capsys):
    (tmp_path / "subs" / "carol").mkdir(parents=True)
    (tmp_path / "subs" / "carol" / "lab03_data_pipeline.ipynb").write_text("{not json")
    out = tmp_path / "grades.csv"
    assert grade.main([str(tmp_path / "subs"), "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "carol/lab03_data_pipeline.ipynb: FAIL" in printed and "1 notebooks of 1 learners graded" in printed
    with open(out) as f:
        assert next(csv.DictReader(f))["problem"].startswith("cannot be read as a notebook")
