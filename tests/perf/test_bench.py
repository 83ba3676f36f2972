"""The offline benchmark (python -m nanoserve bench): records name the model, never a path of the machine."""
from __future__ import annotations

import json

from nanoserve import COURSE_DRAFT_MODEL, COURSE_MODEL, models
from nanoserve.course import bench

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": True}


def test_model_names():
    assert bench.model_name(COURSE_MODEL) == "COURSE_MODEL"
    assert bench.model_name(COURSE_MODEL + "/") == "COURSE_MODEL"
    assert bench.model_name(COURSE_DRAFT_MODEL) == "COURSE_DRAFT_MODEL"
    assert bench.model_name("qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert bench.model_name("/somewhere/on/a/laptop/my-model") == "my-model"


def test_a_run_records_the_model_by_name(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    directory = models.save_random_model(config, tmp_path / "tiny-llama")
    record = bench.main(["--model", str(directory), "--num-requests", "3", "--prompt-len", "4", "8",
                         "--output-len", "2", "5", "--rounds", "1", "--hf-batch-sizes", "2", "--save", str(tmp_path / "out")])
    assert record["model"] == "tiny-llama" and record["device"] == "cpu"
    assert record["identical_outputs"] == 3 and record["ratio"] > 0
    saved = list((tmp_path / "out").glob("offline-*.json"))
    assert len(saved) == 1 and str(tmp_path) not in saved[0].read_text()
