"""nanoserve.validation: one rule per kind of field, and an error that names the field."""
from __future__ import annotations

import math

import pytest

from nanoserve import SamplingParams
from nanoserve.validation import FieldError, check_int, check_number, is_int, is_number


def test_a_bool_is_neither_an_int_nor_a_number():
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(3) and is_number(0.5) and not is_number(False) and not is_number("1")


@pytest.mark.parametrize("value, minimum, none_ok, ok", [
    (1, 1, False, True), (0, 1, False, False), (0, 0, False, True), (True, 0, False, False), (2.0, 1, False, False),
    (None, 0, True, True), (None, 0, False, False), (-1, 0, True, False)])
def test_check_int(value, minimum, none_ok, ok):
    if ok:
        check_int("n", value, minimum=minimum, none_ok=none_ok)
    else:
        with pytest.raises(FieldError) as err:
            check_int("n", value, minimum=minimum, none_ok=none_ok)
        assert err.value.field == "n" and err.value.value is value
        assert str(err.value) == f"n = {value!r}: expected an int >= {minimum}" + (" or None" if none_ok else "")


def test_check_number_refuses_nan_and_bools():
    check_number("temperature", 0, minimum=0)
    for bad in (-0.5, math.nan, True, "0"):
        with pytest.raises(FieldError, match=r"temperature = .*: expected a number >= 0"):
            check_number("temperature", bad, minimum=0)


def test_sampling_params_errors_carry_the_field_and_what_it_expects():
    with pytest.raises(FieldError) as err:
        SamplingParams(top_p=2)
    assert (err.value.field, err.value.expected) == ("top_p", "a number in (0, 1]")
    assert str(err.value) == "SamplingParams.top_p = 2: expected a number in (0, 1]"
    assert isinstance(err.value, ValueError)   # callers that catch ValueError still do
