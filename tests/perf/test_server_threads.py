"""benchmarks/server_threads.py: what it records and what it refuses (the servers themselves run in the benchmark,
about half a minute, not here; `benchmarks/results/server_threads-*.json` holds a run)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("server_threads_benchmark", ROOT / "benchmarks" / "server_threads.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_a_summary_keeps_every_round_and_their_medians():
    runs = [dict(output_throughput=t, median_ttft_ms=10 * t, median_tpot_ms=t / 10, failed=f)
            for t, f in ((100.0, 0), (300.0, 1), (200.0, 0))]
    s = bench.summary(runs)
    assert s["rounds"]["tokens_per_s"] == [100.0, 300.0, 200.0] and s["tokens_per_s"] == 200.0
    assert s["median_ttft_ms"] == 2000.0 and s["median_tpot_ms"] == 20.0 and s["failed"] == 1


def test_one_thread_beside_one_per_core_and_bad_arguments_are_refused(monkeypatch):
    assert bench.settings(4) == {"1 thread": "1", "4 threads": "4"}
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 1)
    with pytest.raises(SystemExit, match="one core"):
        bench.main(["--save", ""])


def test_the_committed_record_has_both_workloads_and_every_round():
    (record,) = [json.loads(p.read_text()) for p in sorted((ROOT / "benchmarks" / "results").glob("server_threads-*.json"))[-1:]]
    assert set(record["workloads"]) == set(bench.WORKLOADS)
    for w in record["workloads"].values():
        assert len(w["servers"]) == 2 and all(len(s["rounds"]["tokens_per_s"]) == record["rounds"] and s["failed"] == 0
                                              for s in w["servers"].values())
