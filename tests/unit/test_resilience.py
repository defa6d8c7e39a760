"""resilience.supervise's backoff (with a fake clock and a fake wait: no real sleeping)."""

from __future__ import annotations

import asyncio

import pytest

from shared import resilience


async def test_the_backoff_starts_over_after_a_healthy_stretch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Five failures in a row back off towards the cap; a loop that then ran HEALTHY_S
    without one waits the first step again at its next blip, not the cap (its failure count
    used to grow for the process's whole life)."""
    now = [0.0]
    waits: list[float] = []
    monkeypatch.setattr(resilience.time, "monotonic", lambda: now[0])

    async def wait(*_events: object, timeout: float) -> bool:
        waits.append(timeout)
        return False

    monkeypatch.setattr(resilience, "wait_any", wait)
    runs = iter([0.0] * 5 + [resilience.HEALTHY_S, None])

    async def loop() -> None:
        ran = next(runs)
        if ran is None:
            return
        now[0] += ran
        raise ConnectionResetError("blip")

    await resilience.supervise("probe", loop, asyncio.Event())
    assert len(waits) == 6
    assert waits[4] >= 1.6  # the fifth in a row: 0.2 s doubled four times, less its jitter
    assert waits[5] <= 0.2  # after a healthy stretch: the first step again
