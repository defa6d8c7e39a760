"""Riding out Postgres, Redis and RabbitMQ outages: supervised loops and a LISTEN that reconnects.

A service's loop that hits a transient error does not crash the process: `supervise` logs it,
waits with capped exponential backoff and jitter, and starts the loop again, so work stalls
while a server is down and resumes by itself. Anything else is a bug and still stops the
service with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiormq.exceptions
import asyncpg
import redis.exceptions

from shared.backoff import retry_delay
from shared.errors import StatementOverran
from shared.runtime import wait_any

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class CacheDamaged(Exception):
    """A cache (Redis's queues) held something it never should (a key of another type):
    repaired where found, and rebuilt from Postgres by the next reconcile; retried like the
    errors below, since a service stopped for a cache's sake would stop every replica."""


# Every error a server restart, failover, connection limit, admin cancel, resource alarm or
# read-only replica produces, from each client library: the one list every service retries
# with backoff. Anything else is a bug and stops the service. Every write is a CAS, so running
# a pass again after any of these is safe.
TRANSIENT: tuple[type[BaseException], ...] = (
    OSError,  # ConnectionRefusedError, ConnectionResetError, socket timeouts
    asyncio.TimeoutError,
    # Postgres
    asyncpg.PostgresConnectionError,  # class 08: the connection failed or was lost
    asyncpg.InterfaceError,  # "connection is closed", "pool is closing"
    asyncpg.InternalClientError,  # a connection broken in the middle of an operation
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.TargetServerAttributeNotMatched,  # a replica where a primary was wanted
    # class 57: admin shutdown, crash shutdown, cannot connect now (starting, recovering),
    # query canceled (pg_cancel_backend, statement_timeout)
    asyncpg.exceptions.OperatorInterventionError,
    # class 53: too many connections, disk full, out of memory
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.ReadOnlySQLTransactionError,  # a failover left us on a standby
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    asyncpg.exceptions.LockNotAvailableError,
    # Postgres aborted our transaction to break a lock cycle or a serialisation conflict.
    # Batches lock rows in id order, so this is a last line of defence, not a path we expect.
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
    # Redis
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,  # a failover left us on a replica
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
    redis.exceptions.OutOfMemoryError,
    # RabbitMQ
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ConnectionClosed,
    aiormq.exceptions.ChannelClosed,
    aiormq.exceptions.DeliveryError,  # a publish nacked (a resource alarm) or returned
    CacheDamaged,
)


HEALTHY_S = 60.0  # a loop that ran this long without a transient error starts its backoff over


def backoff_s(failures: int) -> float:
    """Seconds before try number `failures` + 1: from 0.1-0.2 s, doubling, to 2.5-5 s."""
    return retry_delay(failures - 1, base_s=0.2, cap_s=5.0)


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT)


async def supervise(
    name: str, loop: Callable[[], Awaitable[None]], stopping: asyncio.Event
) -> None:
    """Run `loop` until it returns or `stopping` is set, restarting it after transient errors.
    The backoff starts over once the loop has run HEALTHY_S without one: a blip a day after
    an outage is not waited out as its sixth failure."""
    failures = 0
    while not stopping.is_set():
        began = time.monotonic()
        try:
            await loop()
            return
        except TRANSIENT as exc:
            if time.monotonic() - began >= HEALTHY_S:
                failures = 0
            failures += 1
            delay = backoff_s(failures)
            log.warning(
                "%s: %s: %s; retrying in %.1f s",
                name,
                type(exc).__name__,
                exc,
                delay,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            await wait_any(stopping, timeout=delay)


async def retrying(
    name: str, work: Callable[[], Awaitable[object]], stopping: asyncio.Event
) -> bool:
    """Do `work` until it succeeds (True), backing off between transient failures, or until
    `stopping` is set (False). For writes that must not be dropped, like an outcome."""
    failures = 0
    while True:
        try:
            await work()
            return True
        except TRANSIENT as exc:
            failures += 1
            if stopping.is_set() and failures > 3:
                log.error("%s: giving up while stopping: %s", name, exc)
                return False
            delay = backoff_s(failures)
            log.warning("%s: %s: %s; retrying in %.1f s", name, type(exc).__name__, exc, delay)
            if stopping.is_set():
                await asyncio.sleep(delay)  # draining on shutdown: still worth a few tries
            else:
                await wait_any(stopping, timeout=delay)


async def isolate(
    items: Sequence[T],
    run: Callable[[Sequence[T]], Awaitable[R]],
    alone: Callable[[T, Exception], Awaitable[R]],
    merge: Callable[[R, R], R] = operator.add,
) -> R:
    """`run(items)` as one batch (one statement); if it fails for anything but a transient
    error (then a server is away and the whole batch waits), run the halves apart, down to the
    one item that fails, which `alone` deals with: dead-letters it, refuses it, or writes a
    failure in its place. One poisoned item can never stop the rest, and a clean batch costs
    nothing more. `run` must be safe to repeat for items a failed attempt included (a CAS or
    an idempotent insert), and `items` must not be empty. Results are merged with `merge`.

    A statement canceled (a statement_timeout, or an operator's cancel) or given up at its
    pool's bound (StatementOverran) is transient for one item, but a batch is split: a batch
    too big to finish in the server's time was retried whole, for ever, and held up
    everything behind it."""
    try:
        return await run(items)
    except (asyncpg.exceptions.QueryCanceledError, StatementOverran):
        if len(items) == 1:
            raise
        half = len(items) // 2
        head: Any = await isolate(items[:half], run, alone, merge)
        return merge(head, await isolate(items[half:], run, alone, merge))
    except TRANSIENT:
        raise
    except Exception as exc:
        if len(items) == 1:
            return await alone(items[0], exc)
        half = len(items) // 2
        first: Any = await isolate(items[:half], run, alone, merge)
        return merge(first, await isolate(items[half:], run, alone, merge))
