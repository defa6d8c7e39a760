"""Settings come from the environment, an operator's input: a number that is not finite is
refused with the variable named, where pydantic's bounds alone would let `inf` through (a
recovery period of inf would sleep forever)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.settings import Settings


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize("name", ["recovery_period_s", "node_ttl_s", "aging_s", "node_cpu"])
def test_a_setting_that_is_not_a_finite_number_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"SKED_{name.upper()}", value)
    with pytest.raises(ValidationError, match=name):
        Settings()


def test_finite_settings_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKED_RECOVERY_PERIOD_S", "0.5")
    assert Settings().recovery_period_s == 0.5
