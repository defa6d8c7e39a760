"""A node's backlog: how many dispatches it asks to hold beyond its slots.

A held dispatch is bound to its node: behind a long attempt it waits for that attempt while
another node may have a free slot. So by default (SKED_PREFETCH unset) a node holds a backlog
only while its attempts run short — `rounds` times the mean of its last `window` attempts (about
how long the last dispatch of a backlog `rounds` times its slots deep waits) well under `hold_s`
— and its executor hands a dispatch that waited `hold_s` in the backlog back to Ready, in its
place in line. Such a node starts without a backlog: it earns one by running short attempts,
and loses it on the first hand-back or when its attempts grow long.

The default backlog is two rounds deep (ROUNDS: twice a node's slots). One round only bridges
a scheduler's refill when that takes less than an attempt: with attempts of a few milliseconds
the scheduler's pass (woken by the outcomes, a linger, its statements, the publish) takes
longer than the round the node runs meanwhile, and a node that had run its one round of held
dispatches waited for the next (measured: docs/performance.md, "two rounds").

A fixed backlog (SKED_PREFETCH=N, `hold_s` None) is the operator's word that tasks are short:
always offered, each held dispatch kept until a slot frees.

Pure: the executor feeds it durations and hand-backs, and writes what it advertises to its
node's row, which placement reads.
"""

from __future__ import annotations

from collections import deque

ROUNDS = 2  # the default backlog: this many times a node's slots


class Backlog:
    def __init__(
        self, limit: int, hold_s: float | None, window: int = 32, slots: int | None = None
    ) -> None:
        self.limit = limit  # the most it may advertise
        self.hold_s = hold_s  # how long a dispatch may wait held; None: a fixed backlog
        # rounds of attempts the full backlog covers: `limit` over the node's `slots`
        self.rounds = max(1, -(-limit // slots)) if slots else 1
        self._runs: deque[float] = deque(maxlen=window)
        self.advertised = limit if hold_s is None else 0

    @property
    def on(self) -> bool:
        return self.advertised > 0

    def ran(self, seconds: float) -> bool:
        """An attempt here ran this long; True when what the node advertises changed.

        On when `rounds` times the window's mean is under a quarter of `hold_s` (the whole
        backlog then starts well within it), off above half: the gap keeps a mean near the line
        from switching it every attempt."""
        if self.hold_s is None or self.limit == 0:
            return False
        self._runs.append(max(seconds, 0.0))
        if len(self._runs) < (self._runs.maxlen or 0):
            return False
        mean = self.rounds * sum(self._runs) / len(self._runs)
        if not self.on and mean <= self.hold_s / 4:
            self.advertised = self.limit
            return True
        if self.on and mean > self.hold_s / 2:
            self.advertised = 0
            return True
        return False

    def handed_back(self) -> bool:
        """A held dispatch waited `hold_s` and went back to Ready: off, to be earned again by
        a full window of short attempts. True when that changed what is advertised."""
        if self.hold_s is None:
            return False
        was = self.on
        self.advertised = 0
        self._runs.clear()
        return was
