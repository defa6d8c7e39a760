"""State-change notifications: the payload sked's statements send on `sked_task`, its parser,
and a LISTEN connection that comes back after it drops (then tells its service to sweep for
what it missed)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from uuid import UUID

import asyncpg

from shared.store.db import connect

log = logging.getLogger(__name__)

# One notification per statement that moves tasks (sql/fragments.sql, `notify`): every
# notifying commit serialises on Postgres's notification queue. Payload:
# "<id>:<version>:[d:][w:]<state>" for each task moved (`d:` one with a schedule deadline, `w:`
# a workflow's task), space-separated, up to NOTIFY_LIST_MAX tasks (about 5 KB, under the 8 KB
# limit); a bigger batch sends only "*:<count>:<state,state...>".
TASK_CHANNEL = "sked_task"
# The moves that take a running attempt away from its node (fsm.TAKES_AWAY), in the same
# payload, told again on a channel of their own (sql/fragments.sql, `notify_taken`): what the
# executors and recovery act on, without being woken by every other move.
TAKEN_CHANNEL = "sked_taken"
# A statement that moved tasks into Running only (an executor's claims) is told on a channel
# of its own, in the same payload, instead of TASK_CHANNEL: a start frees, ends and decides
# nothing, so it wakes neither the scheduler nor a waiting client; the relay listens here too.
STARTED_CHANNEL = "sked_started"
NOTIFY_LIST_MAX = 100
# Attempts an admission placed are told to their node on a channel of its own
# (sql/fragments.sql, `placed_channel`, `placed_payload`), by the commit that placed them: its
# executor claims them from there, ahead of the dispatch message (shared.dispatches.placed).
PLACED_PREFIX = "sked_placed_"


def placed_channel(node_id: str) -> str:
    """The channel `node_id`'s new attempts are told on: its id hashed (md5, as the SQL does),
    since a channel name holds at most 63 bytes and a node id may be 63 characters itself."""
    return PLACED_PREFIX + hashlib.md5(node_id.encode(), usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class Notice:
    """A parsed state-change notification: which tasks (None: too many to list), which states,
    which of the tasks belong to a workflow and which have a schedule deadline (None: not
    listed, so any may)."""

    ids: frozenset[UUID] | None
    states: frozenset[str]
    workflow_ids: frozenset[UUID] | None = None
    deadline_ids: frozenset[UUID] | None = None


def may_name(payload: str, states: Iterable[str]) -> bool:
    """False only when the payload moves no task to any of `states`, told without parsing it
    (a UUID per entry): state names have letters no task id, version or count has, so an
    entry naming one always contains it. True may still be a payload of other states."""
    return any(state in payload for state in states)


def parse_notify(payload: str) -> Notice:
    """Read a payload; entries that are not sked's (anyone may NOTIFY) are skipped."""
    if payload.startswith("*:"):
        return Notice(None, frozenset(payload.rsplit(":", 1)[-1].split(",")))
    ids, states, in_workflows, with_deadlines = set(), set(), set(), set()
    for entry in payload.split():
        task_id, _, rest = entry.partition(":")
        rest, _, state = rest.rpartition(":")  # rest: "<version>[:d][:w]"
        try:
            uuid = UUID(task_id)
        except ValueError:
            continue
        ids.add(uuid)
        states.add(state)
        if rest.endswith(":w"):
            in_workflows.add(uuid)
            rest = rest[:-2]
        if rest.endswith(":d"):
            with_deadlines.add(uuid)
    return Notice(
        frozenset(ids), frozenset(states), frozenset(in_workflows), frozenset(with_deadlines)
    )


def states_of(payload: str) -> frozenset[str]:
    """The states a payload names, read without its ids (`parse_notify` builds a UUID per
    entry, ~1 µs each, and a scheduler hears every end). Unlike `parse_notify`, an entry that
    is not sked's counts too: what reads only this may be woken for nothing, never missed."""
    if payload.startswith("*:"):
        return frozenset(payload.rsplit(":", 1)[-1].split(","))
    return frozenset([entry.rpartition(":")[2] for entry in payload.split()])


def versions_of(payload: str) -> dict[UUID, int] | None:
    """Each listed task's version in a payload (see the format above); None if the payload
    does not list its tasks, or holds an entry that is not sked's."""
    versions = {}
    for entry in payload.split():
        task_id, _, rest = entry.partition(":")
        try:
            versions[UUID(task_id)] = int(rest.partition(":")[0])
        except ValueError:
            return None
    return versions


Handler = Callable[[object, int, str, str], None]


class PgListener:
    """LISTEN on channels over one dedicated connection, re-established after it drops.

    `pause()` stops listening (UNLISTEN) until `resume()`: a consumer that polls while it has
    work (the relay) is then not woken by every commit meanwhile, nor is its backend, which
    Postgres signals at each notifying commit only while it listens. Paused, nothing is
    heard: a caller must look for work itself after `resume()` returns."""

    def __init__(
        self,
        dsn: str,
        handlers: Sequence[tuple[str, Handler]],
        on_reconnect: Callable[[], None] | None = None,
    ) -> None:
        self.dsn = dsn
        self.handlers = handlers
        self.on_reconnect = on_reconnect
        self.connected = asyncio.Event()
        self.wanted = True  # listen (the default), or not: pause() and resume()
        self._changed = asyncio.Event()  # `wanted` changed: the connection's task acts on it
        self._settled = asyncio.Event()  # the connection listens, or not, as `wanted` says
        self._settled.set()

    async def pause(self, timeout: float = 5.0) -> None:
        """Stop listening; returns once UNLISTEN holds (see `_want`)."""
        await self._want(False, timeout)

    async def resume(self, timeout: float = 5.0) -> None:
        """Listen again; returns once LISTEN holds (see `_want`)."""
        await self._want(True, timeout)

    async def _want(self, listen: bool, timeout: float) -> None:
        """Returns once the connection does as asked, after `timeout` at most, or at once with
        no connection (a new one does as `wanted` says, and on_reconnect stands for what was
        missed meanwhile)."""
        if self.wanted != listen:
            self.wanted = listen
            self._settled.clear()
            self._changed.set()
        if self.connected.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), timeout)

    async def _listen(self, conn: asyncpg.Connection, on: bool) -> None:
        for channel, handler in self.handlers:
            if on:
                await conn.add_listener(channel, handler)
            else:
                await conn.remove_listener(channel, handler)

    async def run(self, stopping: asyncio.Event) -> None:
        # imported here: they load Redis's and RabbitMQ's clients and tracing, which a process
        # that only reads the store (`sked status`) never needs
        from shared.resilience import TRANSIENT, backoff_s
        from shared.runtime import wait_any

        first = True
        failures = 0
        while not stopping.is_set():
            dropped = asyncio.Event()
            try:
                conn: asyncpg.Connection = await connect(self.dsn)
            except TRANSIENT as exc:
                failures += 1
                delay = backoff_s(failures)
                log.warning("LISTEN: cannot connect (%s); retrying in %.1f s", exc, delay)
                await wait_any(stopping, timeout=delay)
                continue
            try:
                conn.add_termination_listener(lambda _c, ev=dropped: ev.set())
                listening = self.wanted
                if listening:
                    await self._listen(conn, True)
                self._settled.set()
                failures = 0
                self.connected.set()
                if not first:
                    log.warning("LISTEN re-established; sweeping for what was missed")
                    if self.on_reconnect is not None:
                        self.on_reconnect()
                first = False
                while not (dropped.is_set() or stopping.is_set()):
                    self._changed.clear()
                    if listening != self.wanted:
                        listening = self.wanted
                        await self._listen(conn, listening)
                    if listening == self.wanted:
                        self._settled.set()
                    await wait_any(dropped, stopping, self._changed)
                if dropped.is_set():
                    log.warning("LISTEN connection lost")
            except TRANSIENT as exc:
                log.warning("LISTEN: %s", exc)
            finally:
                self.connected.clear()
                if not conn.is_closed():
                    conn.terminate()
