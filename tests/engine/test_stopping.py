"""The engine's stop rules, in one place (nanoserve/engine/stopping.py): the end-to-end cases (a stop string split
across tokens, streamed deltas, speculative steps) are in test_engine.py and test_speculative.py."""
from nanoserve import SamplingParams
from nanoserve.engine.sequence import Sequence, Status
from nanoserve.engine.stopping import StopChecker

EOS = 2


def appended(params: SamplingParams, prompt=(5, 6, 7), out=()) -> Sequence:
    seq = Sequence("r", list(prompt), params)
    seq.token_ids += list(out)
    return seq


def test_a_stop_token_ends_the_sequence_before_its_length_does():
    checker = StopChecker((EOS,), max_model_len=64)
    seq = appended(SamplingParams(max_tokens=2), out=[9, EOS])
    assert checker.check_token(seq, EOS) == "stop" and seq.stop_reason == EOS   # also its last allowed token
    seq = appended(SamplingParams(max_tokens=2), out=[9, 10])
    assert checker.check_token(seq, 10) == "length" and seq.stop_reason is None
    assert checker.check_token(appended(SamplingParams(max_tokens=3), out=[9]), 9) is None


def test_ignore_eos_skips_the_models_eos_but_not_the_requests_stop_tokens():
    checker = StopChecker((EOS,), max_model_len=64)
    assert checker.check_token(appended(SamplingParams(max_tokens=8, ignore_eos=True), out=[EOS]), EOS) is None
    seq = appended(SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[11]), out=[11])
    assert checker.check_token(seq, 11) == "stop" and seq.stop_reason == 11


def test_a_full_window_is_a_length_stop():
    checker = StopChecker((EOS,), max_model_len=5)
    assert checker.check_token(appended(SamplingParams(max_tokens=100), out=[9, 10]), 10) == "length"


def test_a_stop_string_cuts_the_text_before_it_and_the_earliest_one_wins():
    seq = appended(SamplingParams(stop=["END", "\n\n"]))
    seq.text = "def f():\n\n    return 1 END"
    assert StopChecker.check_text(seq) == "\n\n" and seq.text == "def f():"


def test_text_already_sent_is_not_searched_again_but_held_back_text_is():
    seq = appended(SamplingParams(stop=["STOP"]))
    seq.text, seq.num_text_sent = "xSTOP and more", 6     # a match inside the sent text was already seen
    assert StopChecker.check_text(seq) is None
    seq.text, seq.num_text_sent = "abcST", 2               # "ST" held back: may start a stop string
    assert StopChecker.held_back(seq) == 3
    seq.text += "OP"
    assert StopChecker.check_text(seq) == "STOP" and seq.text == "abc"
    seq.status = Status.FINISHED
    assert StopChecker.held_back(seq) == 0                 # a finished request sends everything it has
    assert StopChecker.held_back(appended(SamplingParams())) == 0
