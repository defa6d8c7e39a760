"""The outbox relayed to `sked.events`, in one transaction per pass — lock the free shards, read
their oldest events, publish them with confirms, delete their outbox rows, commit.
A crash before the commit leaves them unpublished and the shards unlocked: the next pass (of
any relay, or of recovery) sends them again. At least once; a duplicate only follows a crash.
"""

from __future__ import annotations

from shared.bus import EVENTS_EXCHANGE, SCHEMA_HEADER, AmqpBus, Outgoing, event_routing_key
from shared.models import SCHEMA_VERSION
from shared.outbox_pack import pack
from shared.store import OutboxRow, Store


def _body(events: list[OutboxRow]) -> bytes:
    """An EventMessage, assembled from the JSON Postgres rendered."""
    inner = ",".join(e.body for e in events)
    return f'{{"schema_version":{SCHEMA_VERSION},"events":[{inner}]}}'.encode()


class OutboxRelay:
    """Publishes the outbox. Any number may run at once; they share the work by shard."""

    def __init__(self, store: Store, bus: AmqpBus, batch: int) -> None:
        self.store = store
        self.bus = bus
        self.batch = batch
        self.published = 0

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
        return len(events)

    async def drain(self) -> int:
        """Passes until the outbox is empty (as far as this relay can see)."""
        total = 0
        while True:
            n = await self.run_once()
            total += n
            if n < self.batch:
                return total
