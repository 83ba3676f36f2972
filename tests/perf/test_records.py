"""nanoserve.course.records: other machines' results, shown with machine, date and commit."""
import json

import pytest

from nanoserve.course import records


def test_every_committed_record_names_its_machine_and_date():
    shown = records.load("**/*-2026*.json")
    assert len(shown) > 10
    for r in shown:
        assert "unrecorded machine" not in r.machine and r.date != "undated", r.path
        assert r.describe().startswith(f"recorded on {r.machine}, {r.date} UTC, ")


def test_a_gpu_run_takes_its_gpu_and_commit_from_machine_json(tmp_path):
    run = tmp_path / "gpu-20260101T000000Z"
    run.mkdir()
    (run / "machine.json").write_text(json.dumps({"gpus": [{"name": "NVIDIA H100"}], "torch": "2.9",
                                                  "commit": "0123456789abcdef", "date": "2026-01-01T00:00:00+00:00"}))
    (run / "kernels-20260101T000100Z.json").write_text(json.dumps({"machine": {"cpu": "Intel"}}))
    (tmp_path / "serving-20260102T030405Z.json").write_text(json.dumps({"machine": {"cpu": "AMD EPYC", "cores": 2}}))
    gpu = records.latest("gpu-*/kernels-*.json", root=tmp_path)
    assert (gpu.machine, gpu.commit, gpu.date) == ("NVIDIA H100 (torch 2.9)", "0123456789", "2026-01-01 00:00")
    cpu = records.latest("serving-*.json", root=tmp_path)
    assert (cpu.machine, cpu.commit, cpu.date) == ("AMD EPYC, 2 cores", None, "2026-01-02 03:04")
    assert "commit not recorded" in cpu.describe()


def test_a_missing_record_is_an_error_that_names_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-\\*"):
        records.load("nothing-*.json", root=tmp_path)
