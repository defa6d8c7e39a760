"""Warnings about refused input, at most one line per interval.

Anyone who can reach an endpoint can make it refuse requests, so a warning per refusal is a
cheap way to fill a disk and drown every other line. The first refusal is logged at once; the
rest within the interval are counted, and the next line logged says how many were held back.
The metrics count every one. (The standard library's logging has no rate limit, and a filter
would drop lines silently: this keeps the count.)
"""

from __future__ import annotations

import logging
import time

EVERY_S = 10.0


class Throttled:
    def __init__(self, log: logging.Logger, every_s: float = EVERY_S) -> None:
        self.log = log
        self.every_s = every_s
        self._next = 0.0  # monotonic time after which a line may be logged again
        self._held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        held, self._held = self._held, 0
        self._next = now + self.every_s
        if held:
            msg = f"{msg} ({held} more held back since the last such line)"
        self.log.warning(msg, *args)
