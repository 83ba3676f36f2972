"""tools/gpu_check.py (`make gpu-check`): refuses without CUDA, and on a GPU runs each step under its limit.

The GPU path is exercised here with stand-in steps (quick Python commands) and a pretend device."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--results", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_exits_non_zero_without_cuda(tmp_path):
    if torch.cuda.is_available():
        return   # this machine has a GPU: `make gpu-check` would really run
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--results", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "sees no CUDA device" in done.stderr and list(tmp_path.iterdir()) == []


def test_the_steps_it_runs_exist():
    for name, cmd, limit in gpu_check.steps(Path("out")):
        scripts = [c for c in cmd if c.endswith(".py")]
        assert all((ROOT / s).is_file() for s in scripts), name
        assert 0 < limit <= gpu_check.BUDGET_S
    by_default = [limit for name, _, limit in gpu_check.steps(Path("out")) if name not in gpu_check.ON_REQUEST]
    assert sum(by_default) <= gpu_check.BUDGET_S
    assert gpu_check.ON_REQUEST <= {name for name, _, _ in gpu_check.steps(Path("out"))}


def test_steps_run_under_their_limits_and_results_are_written(tmp_path, monkeypatch):
    py = sys.executable
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine_info", lambda torch: {"gpus": [{"name": "pretend GPU"}], "torch": "x",
                                                                   "cuda": "y"})
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.5)
    monkeypatch.setattr(gpu_check, "steps", lambda out, *_: [
        ("passes", [py, "-c", "print('fine')"], 30),
        ("fails", [py, "-c", "raise SystemExit(3)"], 30),
        ("hangs", [py, "-c", "import time; time.sleep(60)"], 30),   # stopped where the budget ends
        ("late", [py, "-c", "print('never')"], 30)])
    assert gpu_check.main(["--results", str(tmp_path), "--budget", "4"]) == 1
    (out,) = tmp_path.iterdir()
    assert out.name.startswith("gpu-") and out.name.endswith("Z")
    summary = json.loads((out / "summary.json").read_text())
    by_step = {s["step"]: s for s in summary["steps"]}
    assert by_step["passes"]["returncode"] == 0 and "fine" in (out / "passes.log").read_text()
    assert by_step["hangs"]["timed_out"] and by_step["hangs"]["seconds"] < 10
    assert by_step["fails"]["returncode"] == 3
    assert "skipped" in by_step["late"]   # the budget ran out before it
    assert json.loads((out / "machine.json").read_text())["gpus"][0]["name"] == "pretend GPU"


def test_a_step_on_request_runs_only_when_named(tmp_path, monkeypatch):
    py = sys.executable
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine_info", lambda torch: {"gpus": [{"name": "pretend GPU"}], "torch": "x", "cuda": "y"})
    monkeypatch.setattr(gpu_check, "steps", lambda out, *_: [("quick", [py, "-c", "pass"], 30),
                                                         ("notebooks", [py, "-c", "pass"], 30)])
    ran = []
    for argv in ([], ["--steps", "notebooks"]):
        folder = tmp_path / str(len(ran))
        assert gpu_check.main(["--results", str(folder), *argv]) == 0
        (out,) = folder.iterdir()
        ran.append([s["step"] for s in json.loads((out / "summary.json").read_text())["steps"]])
    assert ran == [["quick"], ["notebooks"]]


def test_the_notebooks_step_runs_on_a_cpu_and_reports_each_notebook(tmp_path):
    """`--device cpu --steps notebooks`: the step as a GPU would run it, on the fixture lab (a few seconds)."""
    nb = ROOT / "tests" / "fixtures" / "solutions" / "lab00_example.ipynb"
    assert gpu_check.main(["--results", str(tmp_path), "--device", "cpu", "--steps", "notebooks",
                           "--notebooks", str(nb)]) == 0
    (out,) = tmp_path.iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and [s["step"] for s in summary["steps"]] == ["notebooks"]
    (row,) = summary["notebooks"]
    assert row["notebook"] == "tests/fixtures/solutions/lab00_example.ipynb" and row["passed"]
    assert row["failed_cells"] == [] and row["seconds"] > 0 and (out / "notebooks" / row["log"]).exists()


def test_the_cpu_runs_nothing_but_the_notebooks_step(tmp_path, capsys):
    for argv in ([], ["--steps", "kernels"], ["--steps", "notebooks", "kernels"]):
        with pytest.raises(SystemExit):
            gpu_check.main(["--results", str(tmp_path), "--device", "cpu", *argv])
    assert "--device cpu runs only notebooks" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_failed_cells_are_read_from_the_junit_xml(tmp_path):
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "tools" / "run_notebooks.py")
    run_notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_notebooks)
    junit = tmp_path / "x.xml"
    junit.write_text('<testsuites><testsuite><testcase name="Cell 0"/><testcase name="Cell 1"><failure message="m"/>'
                     '</testcase><testcase name="Cell 2"><error message="e"/></testcase></testsuite></testsuites>')
    assert run_notebooks.failed_cells(junit) == ["Cell 1", "Cell 2"]
    assert run_notebooks.failed_cells(tmp_path / "missing.xml") == []
