"""The outbox relayed to `sked.events`, in one transaction per pass — lock the free shards, read
their oldest events, publish them with confirms, delete the outbox rows of those confirmed,
commit. A crash before the commit leaves them unpublished and the shards unlocked: the next pass
(of any relay, or of recovery) sends them again. At least once: a duplicate follows a crash, a
confirm that did not come in time, or a message the broker refused (sent again to every queue).
"""

from __future__ import annotations

import logging
import time

import aiormq.exceptions
import asyncpg

from shared.bus import (
    EVENTS_EXCHANGE,
    KNOWN_STATES,
    SCHEMA_HEADER,
    AmqpBus,
    Outgoing,
    event_routing_key,
)
from shared.models import SCHEMA_VERSION
from shared.outbox_pack import pack, waves
from shared.resilience import TRANSIENT
from shared.store import OutboxRow, Store

log = logging.getLogger(__name__)

# The least time between two vacuums of one relay. The rows a vacuum cannot remove (a
# transaction somewhere older than their deletes) stay for the next, which would scan them
# again: this bounds what such a stall costs to one vacuum every so often.
VACUUM_MIN_S = 5.0

# The longest a pass waits for the broker's confirms, all its waves together. The pass holds its
# shards meanwhile, so every other relay waits as long: a frozen link (a partition) or a resource
# alarm (RabbitMQ blocks publishers and keeps the link up) would hold them until AMQP heartbeats
# noticed, or for ever. After it the pass commits what was confirmed and raises TimeoutError.
CONFIRM_TIMEOUT_S = 10.0
# Refusals (nacks) of the same message in a row before the relay logs an error, and then at
# most once in ERROR_EVERY_S.
REFUSALS_BEFORE_ERROR = 8
ERROR_EVERY_S = 60.0


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
        confirm_timeout_s: float = CONFIRM_TIMEOUT_S,
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
        self.confirm_timeout_s = confirm_timeout_s
        # how many passes in a row the broker refused the same message (its first row's id)
        self.refusals = 0
        self._refused_id = 0
        self._said_at = -float("inf")  # time.monotonic() of the last error about it
        self._unknown_said_at = -float("inf")

    async def run_once(self) -> int:
        """One pass: publish up to `batch` events; returns how many were published (their rows
        deleted). A message the broker refused ends the pass, its events and everything that
        follows them left for the next (see `refused`); a confirm that does not come within
        `confirm_timeout_s` or a broken link raises, once the confirmed are committed."""
        async with self.store.transaction() as tx:
            shards = await tx.outbox.lock_free_shards()
            if not shards:
                return 0  # other relays hold every shard; they drain them
            events = await tx.outbox.unpublished(shards, self.batch)
            if not events:
                self.refusals = 0
                return 0
            sent, failure = await self._publish(events)
            if sent:
                await tx.outbox.mark_published([e.id for e in sent])
        self.published += len(sent)
        self._deleted += len(sent)
        if isinstance(failure, aiormq.exceptions.DeliveryError):
            done = {e.id for e in sent}
            self.refused(failure, min(e.id for e in events if e.id not in done))
        elif failure is not None:
            raise failure
        else:
            self.refusals = 0
        await self.vacuum_when_due()
        return len(sent)

    async def _publish(self, events: list[OutboxRow]) -> tuple[list[OutboxRow], Exception | None]:
        """Publish `events` wave by wave (outbox_pack.waves) until a message fails: the events
        confirmed, and the first failure. A wave's messages share no task, and a message goes
        out only once every earlier event of its tasks was confirmed: the events of the
        confirmed messages are, per task, the oldest, and their rows may go."""
        deadline = time.monotonic() + self.confirm_timeout_s
        sent: list[OutboxRow] = []
        for wave in waves(pack(events)):
            left = deadline - time.monotonic()
            if left <= 0:
                return sent, TimeoutError(f"no confirm within {self.confirm_timeout_s:.1f} s")
            outcomes = await self.bus.publish_each(
                EVENTS_EXCHANGE, [self._outgoing(state, batch) for state, batch in wave], left
            )
            failure: Exception | None = None
            for (_, batch), outcome in zip(wave, outcomes, strict=True):
                if outcome is None:
                    sent += batch
                else:
                    failure = failure or outcome
            if failure is not None:
                return sent, failure
        return sent, None

    def _outgoing(self, state: str, batch: list[OutboxRow]) -> Outgoing:
        if state not in KNOWN_STATES:
            now = time.monotonic()
            if now - self._unknown_said_at >= ERROR_EVERY_S:
                self._unknown_said_at = now
                log.warning(
                    "outbox holds events of state %r, which this release does not know (a newer"
                    " release's?): relayed under routing key %s",
                    state[:100],
                    event_routing_key(state),
                )
        return Outgoing(event_routing_key(state), _body(batch), {SCHEMA_HEADER: SCHEMA_VERSION})

    def refused(self, nack: Exception, first_id: int) -> None:
        """Count a refusal of the message holding outbox row `first_id`. RabbitMQ nacks a
        message that a queue would not take — a queue bound to sked.events with `x-overflow:
        reject-publish` (or -dlx) that is full — and every other queue took it; it is sent
        again on the next pass, to them all. Past REFUSALS_BEFORE_ERROR in a row, an error
        says so, at most once in ERROR_EVERY_S: the events after it wait for as long."""
        self.refusals = self.refusals + 1 if first_id == self._refused_id else 1
        self._refused_id = first_id
        log.info("the broker refused an event message (tried again): %s", nack)
        now = time.monotonic()
        if self.refusals >= REFUSALS_BEFORE_ERROR and now - self._said_at >= ERROR_EVERY_S:
            self._said_at = now
            log.error(
                "RabbitMQ refused the event message of outbox row %d %d times in a row (%s):"
                " most likely a queue bound to %s with x-overflow reject-publish is full. Its"
                " tasks' later events wait behind it, and every other subscriber receives it"
                " again on each retry. Drain or unbind that queue, or bound it with drop-head.",
                first_id,
                self.refusals,
                nack,
                EVENTS_EXCHANGE,
            )

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
