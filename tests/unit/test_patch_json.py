"""A move's patch as the CAS reads it (shared.store.moves._patch_json): the same JSON values as
the strict encoder it replaced on the hot path, and a non-finite float refused as before."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.store.moves import _PATCH, _patch_json

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.text(), values, max_size=6))
def test_a_patch_reads_back_as_the_strict_encoder_wrote_it(patch: dict[str, Any]) -> None:
    assert json.loads(_patch_json(patch)) == json.loads(_PATCH.encode(patch))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_float_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        _patch_json({"result": {"x": [1, bad]}})


def test_a_string_naming_nan_is_only_a_string() -> None:
    patch = {"error": "ValueError: NaN and Infinity are not numbers"}
    assert json.loads(_patch_json(patch)) == patch


def test_a_value_json_cannot_hold_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot store"):
        _patch_json({"x": object()})
