"""Settings come from the environment, an operator's input: a number that is not finite is
refused with the variable named, where pydantic's bounds alone would let `inf` through (a
recovery period of inf would sleep forever)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import InvalidSettings
from shared.settings import Settings


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
@pytest.mark.parametrize("name", ["recovery_period_s", "node_ttl_s", "aging_s", "node_cpu"])
def test_a_setting_that_is_not_a_finite_number_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"SKED_{name.upper()}", value)
    with pytest.raises(InvalidSettings, match=f"SKED_{name.upper()}"):
        Settings()


def test_finite_settings_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKED_RECOVERY_PERIOD_S", "0.5")
    assert Settings().recovery_period_s == 0.5


def test_every_setting_is_documented_in_the_readme() -> None:
    """The README's configuration table names every SKED_* variable a process reads."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text("utf-8")
    missing = [f"SKED_{name.upper()}" for name in Settings.model_fields]
    assert [v for v in missing if f"`{v}`" not in readme] == []
