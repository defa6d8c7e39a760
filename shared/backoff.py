"""Retry backoff: capped exponential with jitter (pure)."""

from __future__ import annotations

import random


def retry_delay(
    retries_spent: int, base_s: float, cap_s: float, rnd: random.Random | None = None
) -> float:
    """Seconds to wait before the next attempt.

    The ceiling doubles with each retry spent (base, 2·base, 4·base …) up to `cap_s`; the delay
    is drawn from [ceiling/2, ceiling] ("equal jitter"), so retries of many tasks that failed
    together spread out, yet none comes back sooner than half its ceiling.
    """
    ceiling = min(cap_s, base_s * 2.0 ** min(retries_spent, 62))
    return ceiling / 2 + (rnd or random).uniform(0, ceiling / 2)
