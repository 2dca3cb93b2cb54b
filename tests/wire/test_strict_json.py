"""``kvstore.wire.strict_json``: what ``json.loads`` takes that no message can hold is a
``ValueError`` while parsing; everything else reads as ``json.loads`` reads it."""

from __future__ import annotations

import json

import pytest

from kvstore.wire import strict_json


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [1, -2, 3.5, 9007199254740992, -9007199254740992], "b": null}',
        '{"t": 1.7e9, "small": 1e-300, "s": "NaN"}',
        "[[[[[[[[[[]]]]]]]]]]",
    ],
)
def test_what_a_message_may_hold_reads_as_json_loads_reads_it(text: str) -> None:
    assert strict_json.loads(text) == json.loads(text)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a": 1e400}', "out of range"),
        ('{"a": -1e400}', "out of range"),
        ('{"a": 9007199254740993}', "out of range"),
        ('{"a": %s}' % ("9" * 5000), "out of range"),
        ('{"a": NaN}', "NaN is not a JSON number"),
        ('{"a": Infinity}', "Infinity is not a JSON number"),
        ('{"a": -Infinity}', "-Infinity is not a JSON number"),
        ("{nope", "Expecting property name"),
    ],
)
def test_what_no_message_can_hold_is_a_value_error(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        strict_json.loads(text)
