"""Heartbeats taken in (over HTTP and RabbitMQ), coalesced in memory — the highest sequence per
attempt — and written in one statement per flush, fenced by attempt and sequence in SQL."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from shared import hooks
from shared.errors import one_line
from shared.heartbeat import Beat
from shared.resilience import TRANSIENT, isolate
from shared.store import Store

log = logging.getLogger(__name__)

# How many distinct attempts one flush may carry; beyond it, heartbeats are shed (counted and
# logged) rather than let memory grow: the next beat of a shed attempt is as good.
MAX_PENDING = 100_000

Key = tuple[uuid.UUID, int]


class Beats:
    def __init__(self, store: Store, max_pending: int = MAX_PENDING) -> None:
        self.store = store
        self.max_pending = max_pending
        self.pending: dict[Key, int] = {}  # (task, attempt) -> highest seq
        self.stats = {"received": 0, "applied": 0, "not_applied": 0, "shed": 0, "refused": 0}

    def take(self, beats: Sequence[Beat]) -> int:
        """Coalesce beats in memory (highest seq per attempt). Returns how many were shed."""
        shed = 0
        for beat in beats:
            key = (beat.task_id, beat.attempt)
            known = self.pending.get(key)
            if known is None and len(self.pending) >= self.max_pending:
                shed += 1
                continue
            if known is None or beat.seq > known:
                self.pending[key] = beat.seq
        self.stats["received"] += len(beats)
        self.stats["shed"] += shed
        hooks.heartbeats("accepted", len(beats) - shed)
        hooks.heartbeats("shed", shed)
        return shed

    def refused(self, n: int = 1) -> None:
        self.stats["refused"] += n
        hooks.heartbeats("refused", n)

    async def flush(self) -> int:
        """Write the coalesced beats in one statement; returns how many were applied."""
        if not self.pending:
            return 0
        batch, self.pending = self.pending, {}
        try:
            applied = await self._apply_isolating([(t, a, s) for (t, a), s in batch.items()])
        except TRANSIENT:
            for key, seq in batch.items():  # keep them for the next flush
                if seq > self.pending.get(key, 0):
                    self.pending[key] = seq
            raise
        refused = len(batch) - applied
        self.stats["applied"] += applied
        self.stats["not_applied"] += refused
        hooks.heartbeats("stale", refused)
        if refused:
            # an older attempt, a replayed sequence, or a task that left Running meanwhile
            log.info("%d heartbeat(s) acknowledged but not applied (stale attempt or seq)", refused)
        return applied

    async def _apply_isolating(self, beats: list[tuple[uuid.UUID, int, int]]) -> int:
        """Apply beats; one the statement refuses for its own sake is dropped alone, so it can
        never block the others."""
        if not beats:
            return 0

        async def apply(some: Sequence[tuple[uuid.UUID, int, int]]) -> int:
            return len(await self.store.leases.apply_heartbeats(list(some)))

        async def drop(beat: tuple[uuid.UUID, int, int], exc: Exception) -> int:
            log.warning("heartbeat %s dropped: %s", beat, one_line(exc))
            return 0

        return await isolate(beats, apply, drop)
