"""A node's backlog: how many dispatches it asks to hold beyond its slots.

A held dispatch is bound to its node: behind a long attempt it waits for that attempt while
another node may have a free slot. So by default (SKED_PREFETCH unset) a node holds a backlog
only while its attempts run short, and only as deep as they are short: `r` rounds of its
slots (the last held dispatch then waits about `r` attempts) where `r` times the mean of its
last `window` attempts is well under `hold_s`; its executor hands a dispatch that waited
`hold_s` in the backlog back to Ready, in its place in line. Such a node starts without a
backlog: it earns one by running short attempts, and loses it on the first hand-back or
when its attempts grow long.

At most ROUNDS rounds (four times a node's slots). One round only bridges a scheduler's
refill when that takes less than an attempt: with attempts of a few milliseconds the
scheduler's pass (woken by the outcomes, a linger, its statements, the publish) takes longer
than the round the node runs meanwhile, and a node that had run its held dispatches waited
for the next. Two rounds still ran dry in about half of a burst's outcome statements (the
slots then freed in one statement and claimed in another, after the refill); four keep the
claims in the outcome statements that free their slots (docs/performance.md, the thirteenth
session).

A fixed backlog (SKED_PREFETCH=N, `hold_s` None) is the operator's word that tasks are short:
always offered, each held dispatch kept until a slot frees.

Pure: the executor feeds it durations and hand-backs, and writes what it advertises to its
node's row, which placement reads.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol, TypeVar

ROUNDS = 4  # the deepest default backlog: this many times a node's slots


class Backlog:
    def __init__(
        self, limit: int, hold_s: float | None, window: int = 32, slots: int | None = None
    ) -> None:
        self.limit = limit  # the most it may advertise
        self.hold_s = hold_s  # how long a dispatch may wait held; None: a fixed backlog
        # rounds of attempts the full backlog covers: `limit` over the node's `slots`
        self.rounds = max(1, -(-limit // slots)) if slots else 1
        self._runs: deque[float] = deque(maxlen=window)
        self.depth = self.rounds if hold_s is None else 0  # rounds offered now

    @property
    def advertised(self) -> int:
        """The dispatches offered: `depth` rounds' share of the limit, rounded up (the whole
        limit at `rounds`, which `depth` never exceeds)."""
        return -(-self.limit * self.depth // self.rounds)

    @property
    def on(self) -> bool:
        return self.advertised > 0

    def ran(self, seconds: float) -> bool:
        """An attempt here ran this long; True when what the node advertises changed.

        Deeper, to the most rounds `r` whose `r` times the window's mean is under a quarter
        of `hold_s` (that deep a backlog then starts well within it); shallower when the
        rounds offered times the mean pass half of it, to the most rounds still under that
        half (none, past it for one). The gap keeps a mean near a line from switching it
        every attempt."""
        if self.hold_s is None or self.limit == 0:
            return False
        self._runs.append(max(seconds, 0.0))
        if len(self._runs) < (self._runs.maxlen or 0):
            return False
        mean = sum(self._runs) / len(self._runs)
        depth = self.depth
        deeper = self._most_rounds(mean, self.hold_s / 4)
        if deeper > depth:
            depth = deeper
        elif depth * mean > self.hold_s / 2:
            depth = self._most_rounds(mean, self.hold_s / 2)
        return self._offer(depth)

    def _most_rounds(self, mean: float, within_s: float) -> int:
        """The most rounds (up to `rounds`) a backlog may be deep for its last held dispatch
        to start within `within_s`, at `mean` seconds an attempt."""
        fit = within_s / mean if mean > 0 else float("inf")  # inf too for a denormal mean
        return self.rounds if fit >= self.rounds else max(0, int(fit))

    def _offer(self, depth: int) -> bool:
        """Offer `depth` rounds; True if what is advertised changed."""
        before = self.advertised
        self.depth = depth
        return self.advertised != before

    def handed_back(self) -> bool:
        """A held dispatch waited `hold_s` and went back to Ready: off, to be earned again by
        a full window of short attempts. True when that changed what is advertised."""
        if self.hold_s is None:
            return False
        self._runs.clear()
        return self._offer(0)


def next_in_line(lines: Sequence[float | None], n: int) -> list[int]:
    """The positions of the `n` held dispatches to start next, given each one's task's score
    in the ready line when it was placed (shared.queues.score: priority aged by its wait;
    lower first): in the line's order, ties in arrival order. One without a score (told by a
    placement notification: placed when nothing waited in line) goes first, as it came."""
    first = -math.inf
    keyed = [(first if line is None else line, k) for k, line in enumerate(lines)]
    keyed.sort()  # tuples compared in C: half the time of a key function over 128 held
    return [k for _, k in keyed[:n]]


class Held(Protocol):
    """A held dispatch as the order below reads it (services.executor.node.Item)."""

    line: float | None  # its task's score in the ready line when placed (None: not given)
    received_at: float  # monotonic


H = TypeVar("H", bound=Held)


def take(held: deque[H], n: int) -> list[H]:
    """The `n` held dispatches to start next (`next_in_line`): one held here must not keep a
    higher one placed after it waiting for its slot. The rest stay held in arrival order
    (the hand-back takes the oldest)."""
    picked = next_in_line([item.line for item in held], n)
    if picked == list(range(len(picked))):  # the usual case: they came in line order
        return [held.popleft() for _ in picked]
    chosen = set(picked)
    items = [held[k] for k in picked]
    kept = [item for k, item in enumerate(held) if k not in chosen]
    held.clear()
    held.extend(kept)
    return items


def hold_again(held: deque[H], items: Sequence[H]) -> None:
    """Held dispatches taken and not claimed, back among `held` in arrival order: taken in
    the line's, they may be newer than some left held, and the hand-back reads the oldest
    first (put back in front, an older one waited out twice its hold)."""
    merged = sorted([*items, *held], key=lambda item: item.received_at)
    held.clear()
    held.extend(merged)


def remove(held: deque[H], items: Sequence[H]) -> list[H]:
    """Those of `items` still in `held` (the same objects), taken out of it; the rest keep
    their order."""
    doomed = {id(item) for item in items}
    gone = [item for item in held if id(item) in doomed]
    if gone:
        kept = [item for item in held if id(item) not in doomed]
        held.clear()
        held.extend(kept)
    return gone
