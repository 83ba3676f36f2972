"""benchmarks/decode_latency.py: its record, and the agreement it checks (every variant, eager's greedy tokens).

The benchmark's numbers are not tested (DESIGN.md: tests check correctness, never wall-clock thresholds).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("decode_latency", ROOT / "benchmarks" / "decode_latency.py")
decode_latency = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode_latency)


@pytest.mark.parametrize("argv, message", [
    (["--modes", "cudagraph"], "CUDA graphs need --device cuda"),
    (["--modes", "fast"], "expected some of eager, compile, transformers"),
    (["--batch-sizes", "1", "0"], "--batch-sizes must be at least 1"),
    (["--tokens", "0"], "--tokens must be at least 1"),
    (["--models", "gpt-5"], "invalid choice"),
])
def test_bad_arguments_are_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit):
        decode_latency.parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_fills_in_only_what_is_not_given():
    args = decode_latency.parse_args(["--quick", "--tokens", "5"])
    assert args.models == ["COURSE_DRAFT_MODEL"] and args.batch_sizes == [1] and args.tokens == 5
    assert args.modes == ["eager", "compile", "transformers"]
    assert decode_latency.parse_args([]).models == ["COURSE_MODEL", "qwen2.5-0.5b"]


@pytest.mark.slow
def test_a_quick_run_records_every_variant_and_they_agree(tmp_path):
    # one model, one batch size: two graphs compiled (the engine's and the peer's), ~7 s with warm
    # inductor caches, ~30 s cold on 2 quiet cores (~60 s on a busy machine)
    record = decode_latency.main(["--quick", "--save", str(tmp_path)])
    assert record["benchmark"] == "decode_latency" and record["device"] == "cpu" and record["dtype"] == "float32"
    assert record["threads"] >= 1 and record["machine"]["torch_threads"] == record["threads"]
    rows = {r["variant"]: r for r in record["rows"]}
    assert list(rows) == ["eager", "compile", "transformers"]
    for r in rows.values():
        assert r["model"] == "COURSE_DRAFT_MODEL" and r["batch"] == 1
        assert r["steps"] == record["args"]["tokens"] * record["args"]["rounds"]
        assert r["median_step_s"] > 0 and r["tokens_per_s"] > 0 and r["weight_bytes_per_s"] > 0
        assert r["same_tokens_as_eager"] is True
    assert rows["eager"]["ratio_vs_eager"] == 1 and rows["transformers"]["ratio_vs_peer"] == 1
    assert record["tokens_agree_with_eager"] == {"COURSE_DRAFT_MODEL": {"eager": True, "compile": True,
                                                                        "transformers": True}}
    # steady decode compiles nothing: every graph was compiled in the warm-up
    assert record["graphs_compiled_while_timing"] == 0
    assert record["num_recompiles"] == {"COURSE_DRAFT_MODEL/eager": 0, "COURSE_DRAFT_MODEL/compile": 0}
    (model,) = record["models"]
    assert model["variants"]["compile"]["num_compiles"] == 1
    saved = list(tmp_path.glob("decode_latency-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["rows"] == record["rows"]
