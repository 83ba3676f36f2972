"""`make student` (tools/make_student.py): the learner's bundle holds the course and none of its solutions/."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_student  # noqa: E402


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    folder, archive, files = make_student.build(out, check_labs=False)   # test_make_labs checks labs/ is current
    return folder, archive, files


def test_the_bundle_has_the_course_and_no_solutions(bundle):
    folder, archive, files = bundle
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert on_disk == files
    with zipfile.ZipFile(archive) as zf:
        assert sorted(n.removeprefix(f"{make_student.NAME}/") for n in zf.namelist()) == files

    # what a learner needs
    for rel in ["README.md", "Makefile", "requirements.txt", "requirements-clients.txt", "pyproject.toml", "tools/setup_env.sh", "conftest.py",
                "nanoserve/course_models/base/model.safetensors", "tests/nbval_sanitize.cfg"]:
        assert rel in files, rel
    for folder_name in ("chapters", "labs"):
        expected = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / folder_name).glob("*.ipynb"))
        assert expected and set(expected) <= set(files), folder_name
    # every lab and exercise of solutions/ has its learner's copy, and nothing of solutions/ itself is in
    solution_names = {p.name for p in (ROOT / "solutions").glob("*.ipynb")}
    assert solution_names <= {Path(f).name for f in files if f.startswith("labs/")}
    assert not [f for f in files if f.startswith(("solutions/", "tests/fixtures/"))]
    for rel in ["tools/make_labs.py", "INSTRUCTORS.md", "tests/course/test_lab05.py", "tests/course/test_exercises.py"]:
        assert rel not in files, rel
    # no solution region anywhere, and each lab stops at its TODOs
    assert [rel for rel in files if make_student.leaks(rel, folder)] == []
    lab = json.loads((folder / "labs" / "lab05_memory_bound_kernels.ipynb").read_text())
    assert any("NotImplementedError" in "".join(c["source"]) for c in lab["cells"])


def test_the_bundles_tests_collect_without_solutions(bundle):
    """Inside the bundle the test command's unit half and the chapters collect: no test is left that needs
    the solutions (the lab tests and the exercise tests stay out)."""
    folder = bundle[0]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests", "chapters"],
        cwd=folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    collected = result.stdout
    assert "chapters/00_the_stack.ipynb" in collected and "tests/engine/test_engine.py" in collected
    assert "solutions/" not in collected


def test_a_solution_region_stops_the_build_and_names_the_file(tmp_path):
    root = tmp_path / "repo"
    (root / "labs").mkdir(parents=True)
    (root / "solutions").mkdir()
    (root / "README.md").write_text("the course\n")
    (root / "solutions" / "lab01.ipynb").write_text("{}")
    (root / "labs" / "lab01.ipynb").write_text('{"cells": [{"source": ["x = 1\\n", "### BEGIN SOLUTION\\n"]}]}')
    with pytest.raises(SystemExit, match=r"labs/lab01.ipynb: a solution region \(cell 0\)"):
        make_student.build(tmp_path / "out", root, check_labs=False)
    (root / "labs" / "lab01.ipynb").write_text('{"cells": [{"source": ["raise NotImplementedError\\n"]}]}')
    folder, _, files = make_student.build(tmp_path / "out", root, check_labs=False)
    assert files == ["README.md", "labs/lab01.ipynb"]   # solutions/ left out, the rest in
