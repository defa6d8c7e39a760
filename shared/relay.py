"""The outbox relayed to `sked.events`, in one transaction per pass — lock the free shards, read
their oldest events, publish them with confirms, delete their outbox rows, commit.
A crash before the commit leaves them unpublished and the shards unlocked: the next pass (of
any relay, or of recovery) sends them again. At least once; a duplicate only follows a crash.
"""

from __future__ import annotations

import logging
import time

import asyncpg

from shared.bus import EVENTS_EXCHANGE, SCHEMA_HEADER, AmqpBus, Outgoing, event_routing_key
from shared.models import SCHEMA_VERSION
from shared.outbox_pack import pack
from shared.resilience import TRANSIENT
from shared.store import OutboxRow, Store

log = logging.getLogger(__name__)

# The least time between two vacuums of one relay. The rows a vacuum cannot remove (a
# transaction somewhere older than their deletes) stay for the next, which would scan them
# again: this bounds what such a stall costs to one vacuum every so often.
VACUUM_MIN_S = 5.0


def _body(events: list[OutboxRow]) -> bytes:
    """An EventMessage, assembled from the JSON Postgres rendered."""
    inner = ",".join(e.body for e in events)
    return f'{{"schema_version":{SCHEMA_VERSION},"events":[{inner}]}}'.encode()


class OutboxRelay:
    """Publishes the outbox. Any number may run at once; they share the work by shard."""

    def __init__(
        self,
        store: Store,
        bus: AmqpBus,
        batch: int,
        vacuum_rows: int = 0,
        vacuum_min_s: float = VACUUM_MIN_S,
    ) -> None:
        self.store = store
        self.bus = bus
        self.batch = batch
        self.published = 0
        self.vacuum_rows = vacuum_rows  # 0: never vacuum
        self.vacuum_min_s = vacuum_min_s
        self.vacuums = 0
        self._role_checked = False  # whether this role may vacuum, asked before the first
        self._deleted = 0  # outbox rows deleted since this relay's last vacuum
        self._vacuumed_at = -float("inf")  # time.monotonic() of it

    async def run_once(self) -> int:
        """One pass: publish up to `batch` events; returns how many were published."""
        async with self.store.transaction() as tx:
            shards = await tx.outbox.lock_free_shards()
            if not shards:
                return 0  # other relays hold every shard; they drain them
            events = await tx.outbox.unpublished(shards, self.batch)
            if not events:
                return 0
            await self.bus.publish(
                EVENTS_EXCHANGE,
                [
                    Outgoing(
                        event_routing_key(state), _body(batch), {SCHEMA_HEADER: SCHEMA_VERSION}
                    )
                    for state, batch in pack(events)
                ],
            )
            await tx.outbox.mark_published([e.id for e in events])
        self.published += len(events)
        self._deleted += len(events)
        await self.vacuum_when_due()
        return len(events)

    async def vacuum_when_due(self) -> None:
        """Vacuum the outbox once this relay has deleted `vacuum_rows` rows since it last did
        (and `vacuum_min_s` has passed). Each read walks the key entries of every row deleted
        before the last vacuum (sql/outbox.sql, vacuum_outbox), so without one a relay's pass
        costs more with every event it ever published; this keeps that under ~`vacuum_rows`
        entries, for ~0.5 µs of Postgres's CPU a row vacuumed (docs/performance.md). Not left
        to autovacuum alone: it may be off, as on the development server, or a minute away,
        ~500,000 rows at a burst's rate. A role that may not vacuum the table is told once, and
        the relay stops trying. A failure is logged and tried again later: the events are
        published and their rows deleted either way."""
        if not self.vacuum_rows or self._deleted < self.vacuum_rows:
            return
        now = time.monotonic()
        if now - self._vacuumed_at < self.vacuum_min_s:
            return
        self._vacuumed_at = now
        try:
            if not self._role_checked:
                if not await self.store.outbox.may_vacuum():
                    log.warning(
                        "this relay's database role does not own the outbox and cannot vacuum"
                        " it: its reads slow with every event until autovacuum (or the owner)"
                        " does; see SKED_RELAY_VACUUM_ROWS"
                    )
                    self.vacuum_rows = 0  # said once; not tried again
                    return
                self._role_checked = True
            await self.store.outbox.vacuum()
        except (asyncpg.PostgresError, *TRANSIENT) as exc:
            log.warning("vacuuming the outbox failed (tried again later): %s", exc)
            return
        self._deleted = 0
        self.vacuums += 1

    async def drain(self) -> int:
        """Passes until the outbox is empty (as far as this relay can see)."""
        total = 0
        while True:
            n = await self.run_once()
            total += n
            if n < self.batch:
                return total
