"""jsonvalue.parse skips walking a value when its text cannot hold what the walk looks for:
these check that the shortcut never lets through what `problem` refuses (the reasons are
tests/unit/test_hostile.py's)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import jsonvalue
from shared.jsonvalue import MAX_DEPTH, Unsafe, parse, problem

TEXT = st.text(alphabet=st.sampled_from(["a", "é", "\x00", "\ud800", "\udfff", "\\", '"', "u"]))
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=30,
)


def verdict(text: str) -> str | None:
    try:
        parse(text.encode("utf-8"))
    except Unsafe as exc:
        return str(exc)
    return None


def nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@given(VALUES, st.booleans())
def test_parse_refuses_exactly_what_problem_finds(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # a raw lone surrogate: such bytes are not UTF-8, refused before parsing
    # what the text means: json.dumps writes a high and a low surrogate side by side as a
    # pair of escapes, which any reader joins into one character ("\ud800\udfff" is
    # U+103FF), so the walk judges the text's value, not the one it was made from
    meant = json.loads(text)
    nan = any(isinstance(v, float) and math.isnan(v) for v in _leaves(meant))  # NaN != NaN
    refused = verdict(text)
    assert (refused is not None) == (problem(meant) is not None)
    if refused is None and not nan:
        assert parse(text.encode()) == meant


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, MAX_DEPTH + 2])
@pytest.mark.parametrize("leaf", [1, [], {}, "x", "]" * 70, "[{" * 70, {"k]": "\\]"}])
def test_nesting_at_the_limit_is_judged_as_the_walk_judges_it(depth: int, leaf: Any) -> None:
    value = nested(depth, leaf)
    # wide as well as deep: more brackets than MAX_DEPTH, so the count alone cannot decide
    wide = [value, *([[1]] * MAX_DEPTH)]
    # closing brackets inside a string ahead of the deep part must not be counted against it
    behind = ["]}" * 70, value]
    for v in (value, wide, behind):
        assert (verdict(json.dumps(v)) is None) == (problem(v) is None)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = json.dumps({"s": "[" * 500 + '\\"{' * 100, "t": ["]]]"] * 40})
    assert verdict(text) is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"a": "x\\u0000"}', "a holds a NUL character"),
        ('{"a": ["\\uDBFF"]}', "a[0] holds a lone surrogate"),
        ('{"a": 1e400}', "a is inf, not a JSON number"),
        ('{"a": -2E+308}', "a is -inf, not a JSON number"),
    ],
)
def test_what_only_escapes_and_literals_carry_is_still_found(text: str, reason: str) -> None:
    found = verdict(text)
    assert found is not None
    assert reason in found


def test_an_escaped_backslash_before_u0000_is_text_not_a_nul() -> None:
    assert verdict('{"a": "\\\\u0000"}') is None  # falls back to the walk, which agrees
    assert parse(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a surrogate pair


def test_same_json_compares_numbers_by_value_and_nothing_else_loosely() -> None:
    """A spec read back from jsonb against the one submitted again: 1e23 comes back as the
    integer 10**23 and is the same number; true is not 1, "1" is not 1, and an integer past
    any float is the same only as an equal integer."""
    same = [
        (1e23, 10**23),
        ({"a": [1.5, {"b": 1e-7}]}, {"a": [1.5, {"b": 1e-7}]}),
        (10**400, 10**400),
        (2, 2.0),
    ]
    different = [
        (True, 1),
        (1, True),
        ("1", 1),
        (None, 0),
        ([1, 2], [2, 1]),
        ({"a": 1}, {"a": 1, "b": 2}),
        (10**400, 1e308),
        ({"a": [1]}, {"a": [[1]]}),
    ]
    assert all(jsonvalue.same_json(a, b) and jsonvalue.same_json(b, a) for a, b in same)
    assert not any(jsonvalue.same_json(a, b) for a, b in different)


@given(VALUES)
def test_the_size_floor_never_exceeds_the_cleaned_json_s_size(value: Any) -> None:
    """`storable` and the handler worker refuse a result by `cleaned_size_floor` of its text
    without walking it: the floor must never be over what the walk would make of it."""
    try:
        cleaned = jsonvalue.clean(value)
    except ValueError:
        return  # NaN, Infinity, keys that collide once escaped: refused by the walk anyway
    floor = jsonvalue.cleaned_size_floor(json.dumps(value))
    assert floor <= len(json.dumps(cleaned))
    assert floor == jsonvalue.cleaned_size_floor(json.dumps(value).encode())


def test_keys_that_collide_once_escaped_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="same once escaped"):
        jsonvalue.clean({"k\x00": 1, "k\\0": 2})
    assert jsonvalue.clean({"k\x00": 1, "k": 2}) == {"k\\0": 1, "k": 2}


@given(VALUES, st.integers(min_value=1, max_value=40))
def test_few_counts_the_values_the_walk_visits(value: Any, limit: int) -> None:
    def count(v: Any) -> int:
        if isinstance(v, dict):
            return 1 + sum(count(x) for x in v.values())
        if isinstance(v, list):
            return 1 + sum(count(x) for x in v)
        return 1

    assert jsonvalue.few(value, limit) == (count(value) <= limit)
