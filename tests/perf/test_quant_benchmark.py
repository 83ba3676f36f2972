"""benchmarks/quantization.py: its arguments, its byte counts, and a short run's record (every row, sane fields).

The benchmark's numbers are not tested (DESIGN.md: tests check correctness, never wall-clock thresholds).
The run uses a tiny Qwen2-shaped config written to a temporary directory (2 layers, hidden 128), so the
compiled rows compile in seconds rather than the minutes a real shape takes on 2 cores.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from nanoserve import models, quant

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("quantization_benchmark", ROOT / "benchmarks" / "quantization.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench   # torch.compile traces the peer's layer, a class of this module: it must be importable
spec.loader.exec_module(bench)

TINY = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize("argv, message", [
    (["--variants", "int3"], "invalid choice"),
    (["--batch", "1", "0"], "--batch must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--model", "gpt-5"], "--model 'gpt-5'"),
])
def test_bad_arguments_are_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_fills_in_only_what_is_not_given():
    args = bench.parse_args(["--quick", "--steps", "2"])
    assert args.model == "smollm2-135m" and args.steps == 2 and args.rounds == bench.QUICK["rounds"]
    assert args.variants == bench.NAMES and args.batch == [1]
    assert bench.parse_args([]).model == "qwen2.5-0.5b"
    # asked in any order, run in the table's order
    assert bench.parse_args(["--variants", "int8", "fp32"]).variants == ["fp32", "int8"]


def test_weight_bytes_agree_with_linear_weight_bytes_and_count_the_peer(tiny_config):
    model = models.random_model(tiny_config)
    assert bench.weight_bytes(model) == quant.linear_weight_bytes(model)
    int8 = quant.quantize_model(copy.deepcopy(model), "int8")
    assert bench.weight_bytes(int8) == quant.linear_weight_bytes(int8)
    # the peer: the same int8 codes, the scales (and q/k/v biases) in bf16
    peer = bench.gpt_fast_int8(copy.deepcopy(model).to(torch.bfloat16))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    codes = sum(m.weight.numel() for m in linears)
    extras = sum(m.out_features + (m.bias.numel() if m.bias is not None else 0) for m in linears)
    assert bench.weight_bytes(peer) == codes + 2 * extras


def test_the_peer_layer_is_the_int8_recipe():
    lin = torch.nn.Linear(64, 32, bias=True)
    layer = bench.GptFastInt8Linear(lin, torch.float32)
    q, scales = quant.quantize_int8(lin.weight.detach())
    assert torch.equal(layer.weight, q) and torch.equal(layer.scales, scales)
    x = torch.randn(3, 64)
    expected = x @ (q.float() * scales[:, None]).t() + lin.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)   # 2-D in, 2-D out
    assert layer(x[None]).shape == (1, 3, 32)


def test_a_row_that_fails_is_recorded_with_its_error_not_hidden(tiny_config, monkeypatch):
    real = bench.perf.DecodeTimer

    def timer(model, *args, compilation="eager", **kwargs):
        if compilation != "eager":
            raise RuntimeError("cannot compile this\nsecond line")
        return real(model, *args, compilation=compilation, **kwargs)

    monkeypatch.setattr(bench.perf, "DecodeTimer", timer)
    record = bench.main(["--model", str(tiny_config), "--variants", "fp32", "int8", "int8+compile",
                         "--rounds", "1", "--steps", "1", "--save", ""])
    assert [r["variant"] for r in record["rows"]] == ["fp32", "int8"]
    (failure,) = record["failed"]
    assert failure["variant"] == "int8+compile" and failure["batch"] == 1
    assert failure["error"] == "RuntimeError: cannot compile this\nsecond line"
    assert record["targets"][0]["result"] in ("PASS", "FAIL") and record["targets"][1]["result"] == "n/a"


@pytest.mark.slow
def test_a_short_run_records_every_row(tiny_config, tmp_path):
    # two compiled rows (three with torchao installed): ~15 s on 2 cores with warm inductor caches, ~40 s with
    # none (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), ~70 s that way with torchao on a busy machine
    record = bench.main(["--model", str(tiny_config), "--quick", "--rounds", "1", "--steps", "2",
                         "--save", str(tmp_path)])
    assert record["benchmark"] == "quantization" and record["device"] == "cpu"
    assert record["model"]["parameters"] > 0 and record["read_bytes_per_s"] > 0
    rows = {r["variant"]: r for r in record["rows"]}
    skipped = {s["variant"]: s["reason"] for s in record["skipped"]}
    failed = {f["variant"]: f["error"] for f in record["failed"]}
    # every variant is accounted for exactly once: measured, skipped (with why) or failed (with the error)
    assert sorted([*rows, *skipped, *failed]) == sorted(bench.NAMES)
    assert all(skipped.values()) and all(failed.values())
    for name in ("fp32", "bf16", "int8", "int4", "int4-g32", "gpt-fast-int8", "gpt-fast-int8-eager"):
        assert name in rows, f"{name}: {skipped.get(name) or failed.get(name)}"
    if record["torchao"]["available"]:
        assert "torchao-int8" in rows or "torchao-int8" in failed
    else:
        assert set(skipped) >= {"torchao-int8", "torchao-int4"}
    for r in rows.values():
        assert r["batch"] == 1 and r["steps"] == 2
        assert r["median_step_s"] > 0 and r["tokens_per_s"] > 0 and r["utilisation"] > 0
        assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_read_bytes_per_seq"] + r["embedding_row_bytes"]
        assert r["achieved_bytes_per_s"] == pytest.approx(r["bytes_per_step"] / r["median_step_s"])
        assert r["speedup_vs_fp32"] > 0 and r["speedup_vs_peer"] > 0
        assert r["graphs_compiled_while_timing"] == 0
        assert (r["compile_s"] > 0) == (r["compilation"] == "compile")
    assert rows["fp32"]["speedup_vs_fp32"] == 1 and rows["gpt-fast-int8"]["speedup_vs_peer"] == 1
    # fewer bytes per weight, fewer bytes per step; the peer holds our int8's codes, its scales in bf16
    w = {n: r["weight_bytes"] for n, r in rows.items()}
    assert w["fp32"] == 2 * w["bf16"] and w["int4"] < w["int4-g32"] < w["int8"] < w["bf16"]
    assert rows["int8"]["dtype"] == "float32" and rows["gpt-fast-int8"]["dtype"] == "bfloat16"
    # inductor fused the peer's dequantisation into the matmul in every linear layer, the head included
    assert rows["gpt-fast-int8"]["woq_fusions"] == 7 * TINY["num_hidden_layers"] + 1
    # the targets are reported as measured, never asserted by the script: PASS exactly when the ratio meets them
    (int8_vs_fp32, int4_vs_int8) = record["targets"]
    assert int8_vs_fp32["result"] == ("PASS" if int8_vs_fp32["ratio"] >= 2 else "FAIL")
    assert int4_vs_int8["result"] == ("PASS" if int4_vs_int8["ratio"] > 1 else "FAIL")
    saved = list(tmp_path.glob("quantization-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["rows"] == record["rows"]
