"""EngineArgs: the engine's options written once, read by LLM(**kwargs), the command line and the server."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from nanoserve import LLM, EngineArgs
from nanoserve.serve import server
from nanoserve.validation import FieldError


def test_the_defaults_validate_and_every_field_is_an_llm_keyword():
    args = EngineArgs().validate()
    assert args.kwargs() == {f.name: f.default for f in fields(EngineArgs)}
    llm = LLM(device="cpu", max_num_seqs=3, num_kv_blocks=64)
    assert llm.args.max_num_seqs == 3 and llm.engine.config.max_num_seqs == 3
    assert llm.engine.config.num_kv_blocks == 64


def test_an_unknown_keyword_names_itself_and_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown engine argument 'max_num_seq'.*max_num_seqs"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("name, value, expected", [
    ("max_num_seqs", 0, "an int >= 1"), ("block_size", True, "an int >= 1"), ("max_num_batched_tokens", 2.0, "an int"),
    ("max_model_len", -1, "an int >= 1 or None"), ("seed", -1, "an int >= 0"),
    ("gpu_memory_utilization", 1.5, r"a number in \(0, 1\]"), ("gpu_memory_utilization", 0, r"in \(0, 1\]")])
def test_a_bad_number_is_an_error_carrying_its_field(name, value, expected):
    with pytest.raises(FieldError, match=expected) as caught:
        EngineArgs(**{name: value}).validate()
    assert caught.value.field == name
    with pytest.raises(FieldError, match=name):   # LLM checks them before it loads anything
        LLM(**{name: value})


def test_what_a_sharded_engine_cannot_do_yet_is_refused_before_any_process():
    with pytest.raises(ValueError, match="quantization = 'int8' with tensor_parallel_size = 2"):
        LLM(device="cpu", tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="speculative_config = .* with tensor_parallel_size = 2"):
        LLM(device="cpu", tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_every_option_is_a_flag_with_its_default_and_vllms_spelling():
    ap = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(ap.parse_args([])) == EngineArgs()
    args = EngineArgs.from_cli_args(ap.parse_args([
        "--max-num-seqs", "4", "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching", "--enforce-eager",
        "--gpu-memory-utilization", "0.5", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--compilation", "compile", "--scheduling", "static", "--kv-cache-memory", "1048576"]))
    assert (args.max_num_seqs, args.num_kv_blocks, args.enable_prefix_caching, args.enforce_eager) == (4, 64, False, True)
    assert args.gpu_memory_utilization == 0.5 and args.speculative_config["method"] == "ngram"
    assert (args.compilation, args.scheduling, args.kv_cache_memory) == ("compile", "static", 1 << 20)
    with pytest.raises(SystemExit):
        ap.parse_args(["--compilation", "fast"])


def test_the_server_and_the_command_line_take_the_same_engine_flags():
    engine_dests = {f.name for f in fields(EngineArgs) if f.metadata["cli"]}
    serve_dests = {a.dest for a in server.parser()._actions}
    assert engine_dests <= serve_dests
    parsed = server.parser().parse_args(["--max-num-seqs", "2", "--port", "9"])
    assert EngineArgs.from_cli_args(parsed) == EngineArgs(max_num_seqs=2)
