"""Warnings about refused input are throttled, and say how many were held back."""

from __future__ import annotations

import logging

import pytest

from shared import throttle
from shared.throttle import Throttled


def test_one_line_per_interval_with_the_count_held_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    warn = Throttled(logging.getLogger("t"), every_s=10)
    with caplog.at_level(logging.WARNING):
        for i in range(1000):  # a flood within one interval: one line
            warn.warning("refused %d", i)
        now[0] += 9.9
        warn.warning("refused %d", 1000)
        now[0] += 0.2
        warn.warning("refused %d", 1001)  # the interval is over: a line, with the count
        now[0] += 60
        warn.warning("refused %d", 1002)  # nothing held back since
    assert [r.getMessage() for r in caplog.records] == [
        "refused 0",
        "refused 1001 (1000 more held back since the last such line)",
        "refused 1002",
    ]
