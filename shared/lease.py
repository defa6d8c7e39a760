"""The timing of attempt leases (pure): when an executor renews, and how long a renewal lets
an attempt's processes run before the node's watchdog freezes them.

Postgres holds a lease until `lease_until` = (the renewing statement's now()) + the task's
heartbeat timeout L. The executor notes its monotonic clock before it sends the statement
(`sent_at`); Postgres ran it no earlier, so the lease lasts at least until sent_at + L. The
watchdog freezes the tree at sent_at + L - guard: a guard early, measured on this host's
monotonic clock, never compared with anyone's wall clock. The heartbeat-monitor declares the
attempt Lost (and a next attempt may start) only after lease_until + margin, by Postgres's
clock. So the old processes stop at least guard + margin before a new attempt can start;
docs/architecture.md ("At most one live attempt") has the whole argument.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_GUARD_S = 1.0


def guard_s(timeout_s: float) -> float:
    """How much sooner than Postgres's lease the watchdog acts: a tenth of it, at most 1 s."""
    return min(0.1 * timeout_s, MAX_GUARD_S)


def remaining_s(timeout_s: float, sent_at: float, now: float) -> float:
    """Seconds from `now` the processes may run on a renewal sent at `sent_at` (monotonic)."""
    return sent_at + timeout_s - guard_s(timeout_s) - now


def renew_every_s(beat_s: float, timeouts: Iterable[float]) -> float:
    """How often an executor renews: its heartbeat period, or a quarter of the shortest lease
    it holds if that is shorter, so that three renewals in a row may fail before any lapses."""
    return min([beat_s, *(t / 4 for t in timeouts)])
