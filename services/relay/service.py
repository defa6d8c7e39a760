"""The relay loop: drain unpublished task_events to RabbitMQ, woken by NOTIFY, swept on a timer.

One pass, in one transaction: lock the free outbox shards (FOR UPDATE SKIP LOCKED), read their
oldest unpublished events, publish them with confirms, mark them published, commit. A crash
before the commit leaves the events unpublished and the shards unlocked, so the next pass (of
any relay) sends them again: at least once, and a duplicate only ever follows a crash.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from uuid import UUID

import asyncpg

from services.relay.logic import pack
from shared.bus import EVENTS_EXCHANGE, SCHEMA_HEADER, AmqpBus, Outgoing, event_routing_key
from shared.fsm import State
from shared.models import SCHEMA_VERSION
from shared.repo import TASK_CHANNEL
from shared.resilience import PgListener, supervise
from shared.runtime import wait_any
from shared.settings import Settings

log = logging.getLogger(__name__)

LOCK_FREE_SHARDS = "SELECT shard FROM outbox_shards ORDER BY shard FOR UPDATE SKIP LOCKED"

# Postgres renders each event's JSON (models.Event's fields): the relay only concatenates,
# which keeps its CPU per event to a few microseconds.
UNPUBLISHED = """
SELECT id, task_id, to_status,
       json_build_object('id', id, 'task_id', task_id, 'from_status', from_status,
                         'to_status', to_status, 'version', version, 'attempt', attempt,
                         'reason', reason, 'at', at)::text AS body
FROM task_events
WHERE published_at IS NULL AND shard = ANY($1::smallint[])
ORDER BY id
LIMIT $2
"""

MARK_PUBLISHED = "UPDATE task_events SET published_at = now() WHERE id = ANY($1::bigint[])"


@dataclass(frozen=True)
class _Row:
    id: int
    task_id: UUID
    to_status: State
    body: str


def _body(events: list[_Row]) -> bytes:
    """An EventMessage, assembled from the JSON Postgres rendered."""
    inner = ",".join(e.body for e in events)
    return f'{{"schema_version":{SCHEMA_VERSION},"events":[{inner}]}}'.encode()


class Relay:
    """Publishes the outbox. Any number may run at once; they share work by shard."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, bus: AmqpBus) -> None:
        self.settings = settings
        self.pool = pool
        self.bus = bus
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self.published = 0

    async def run_once(self) -> int:
        """One pass: publish up to `relay_batch` events; returns how many were published."""
        async with self.pool.acquire() as conn, conn.transaction():
            shards = [row["shard"] for row in await conn.fetch(LOCK_FREE_SHARDS)]
            if not shards:
                return 0  # another relay holds every shard; its loop will drain them
            rows = await conn.fetch(UNPUBLISHED, shards, self.settings.relay_batch)
            if not rows:
                return 0
            events = [_Row(r["id"], r["task_id"], State(r["to_status"]), r["body"]) for r in rows]
            await self.bus.publish(
                EVENTS_EXCHANGE,
                [
                    Outgoing(
                        event_routing_key(state), _body(batch), {SCHEMA_HEADER: SCHEMA_VERSION}
                    )
                    for state, batch in pack(events)
                ],
            )
            await conn.execute(MARK_PUBLISHED, [e.id for e in events])
        self.published += len(events)
        return len(events)

    async def drain(self) -> int:
        total = 0
        while True:
            n = await self.run_once()
            total += n
            if n < self.settings.relay_batch:
                return total

    def _notified(self, *_: object) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Drain at start (nothing stranded), then on every NOTIFY and every sweep period."""
        listener = PgListener(
            self.settings.database_url, [(TASK_CHANNEL, self._notified)], self._wake.set
        )
        async with asyncio.TaskGroup() as group:
            group.create_task(listener.run(self._stopping))
            group.create_task(supervise("relay", self._loop, self._stopping))
            await asyncio.wait_for(listener.connected.wait(), None)
            log.info("relay listening on %s", TASK_CHANNEL)

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before draining: a NOTIFY during the drain means go again
            n = await self.drain()
            if n:
                log.debug("relayed %d events", n)
            await wait_any(self._wake, self._stopping, timeout=self.settings.relay_sweep_s)
            # Linger a moment after a wake-up so that one pass carries the events of many
            # transitions: a pass per NOTIFY would cost Postgres a transaction per event.
            await wait_any(self._stopping, timeout=self.settings.relay_linger_s)

    def stop(self) -> None:
        self._stopping.set()
