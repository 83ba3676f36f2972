"""The rules an argument or a request field follows, written once: an int that is not a bool, at least some bound.

Every check raises `FieldError`, a ValueError that carries the field's name and what it expects, so a caller
that reports errors field by field (the server's OpenAI error JSON) reads them instead of parsing a message.
The message reads `<owner><field> = <value>: expected <what>`, e.g. "SamplingParams.top_p = 2: expected a
number in (0, 1]".
"""
from __future__ import annotations


class FieldError(ValueError):
    """`value` breaks the rule of `field`; `expected` says what the field takes."""

    def __init__(self, field: str, value: object, expected: str, owner: str = ""):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"{owner}{field} = {value!r}: expected {expected}")


def is_int(value: object) -> bool:
    """An int, and not a bool (JSON's true is a Python bool, and a bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(field: str, value: object, *, minimum: int = 1, none_ok: bool = False, owner: str = "") -> None:
    """A FieldError unless `value` is an int >= `minimum` (or None, when `none_ok`)."""
    if value is None and none_ok:
        return
    if not is_int(value) or value < minimum:
        raise FieldError(field, value, f"an int >= {minimum}" + (" or None" if none_ok else ""), owner)


def check_number(field: str, value: object, *, minimum: float, owner: str = "") -> None:
    """A FieldError unless `value` is a number >= `minimum` (NaN is not)."""
    if not is_number(value) or not value >= minimum:
        raise FieldError(field, value, f"a number >= {minimum:g}", owner)
