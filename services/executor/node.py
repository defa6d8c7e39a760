"""What one executor's parts share: the node's identity and collaborators, the attempts it
runs, and the queues between its loops (start -> outcomes -> finish; suspects -> watch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import ChannelInvalidStateError

from services.executor.backends import Backend, Key, Launch, Outcome
from shared import fsm, heartbeat, lease
from shared.backlog import Backlog
from shared.bus import AmqpBus
from shared.dispatches import Entry, line_of, placed, unpack
from shared.fsm import State
from shared.models import Dispatch, Task
from shared.outcome import Report
from shared.policy import JobPolicy
from shared.queues import ReadyQueue
from shared.resilience import TRANSIENT
from shared.settings import Settings
from shared.store import Store

log = logging.getLogger(__name__)

ENDED_KEPT = 4096  # attempts ended here that a late dispatch of is recognised by (Node.ended)


class Delivery:
    """One message from the node's queue: acknowledged once every dispatch in it is settled
    (its attempt's outcome written, its claim lost, or the entry refused). `message` is None
    for a placement's notification (`Node.placed`): nothing to acknowledge."""

    __slots__ = ("left", "message")

    def __init__(self, message: AbstractIncomingMessage | None, entries: int) -> None:
        self.message = message
        self.left = entries


class Item:
    """One dispatch as delivered: an entry of a message (shared.dispatches)."""

    __slots__ = ("delivery", "entry", "line", "received_at", "settled")

    def __init__(self, delivery: Delivery, entry: Entry, received_at: float) -> None:
        self.delivery = delivery
        self.entry = entry
        self.received_at = received_at  # monotonic: how long it has been held
        self.settled = False
        # its task's score in the ready line when placed (lower first); None: not given (a
        # placement notification's, placed when nothing waited in line)
        self.line = line_of(entry.headers)

    @property
    def dispatch(self) -> Dispatch | None:
        return self.entry.dispatch

    @property
    def headers(self) -> Mapping[str, Any]:
        return self.entry.headers

    def settle(self) -> bool:
        """Mark this dispatch done with; True when it was the last open one of its message."""
        if self.settled:
            return False
        self.settled = True
        self.delivery.left -= 1
        return self.delivery.left == 0


def items_of(message: AbstractIncomingMessage) -> list[Item]:
    """The dispatches a message carries, each read and checked alone."""
    entries = unpack(message.body, message.headers)
    delivery = Delivery(message, len(entries))
    now = time.monotonic()
    return [Item(delivery, e, now) for e in entries]


@dataclass
class Attempt:
    task: Task  # as it stood after this executor's Scheduling -> Running CAS
    message: Item | None  # its dispatch; None: adopted, not dispatched
    # monotonic time before the statement that last renewed its lease was sent
    renewed_at: float = 0.0


class Node:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: AmqpBus,
        backend: Backend,
        queue: ReadyQueue,
        stopping: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.id = settings.node_id
        self.secret = settings.require_heartbeat_secret()
        self.store = store
        self.bus = bus
        self.backend = backend
        self.queue = queue
        self.stopping = stopping
        # set once a stopping executor's drain is over: until then its attempts' leases are
        # renewed and those taken away stopped, as they may run out the shutdown grace
        self.drained = asyncio.Event()
        self.policy = JobPolicy.of(settings.allowed_handlers, settings.allowed_commands)
        self.boot_id = uuid4()  # this incarnation: the owner of the leases it takes
        # the node ids whose dispatches this executor takes (services.executor.serving)
        self.serves: set[str] = {self.id} if backend.offers() is None else set()
        self.active: dict[Key, Attempt] = {}
        # A local node claims an attempt only while fewer than `slots` hold it (`running`);
        # `slot_freed` is set when outcomes are written — not when known: then the record
        # never shows a node more attempts Running than its slots (the next attempt's
        # started_at comes after the last one's finished_at). With a backlog (SKED_PREFETCH)
        # RabbitMQ hands the node up to slots + prefetch messages; and as a message carries
        # many dispatches, the gate, not the prefetch, is what keeps a node from running more
        # than its slots while a superseded attempt is still on its way out.
        self.gated = backend.offers() is None
        self.slot_freed = asyncio.Event()
        # the backlog this node holds now (none until its attempts prove short); the nodes
        # loop writes it to the node's row when `backlog_changed` is set
        limit = settings.backlog_limit if self.gated else 0
        self.backlog = Backlog(limit, settings.backlog_hold, slots=settings.slots)
        self.backlog_changed = asyncio.Event()
        # outcomes known here but not yet written: a probe gets the real outcome from these
        self.unreported: dict[Key, Outcome] = {}
        # set when every attempt holding a slot has its outcome known (`all_reported`): the
        # finisher stops waiting for more to join its batch
        self.reported = asyncio.Event()
        # the dispatches of each message, or notification, received (None: stop)
        self.inbox: asyncio.Queue[list[Item] | None] = asyncio.Queue()
        # attempts started here whose outcomes are written, the latest ENDED_KEPT: a dispatch
        # of one arriving now (the message behind its placement's notification, a
        # redelivery) is settled without a claim statement that could only lose
        self.ended: OrderedDict[Key, None] = OrderedDict()
        self.acks = Acks()  # every delivery on the consumer channel is recorded here
        self.outcomes: asyncio.Queue[tuple[Attempt, Outcome] | None] = asyncio.Queue()
        self.runs: set[asyncio.Task[None]] = set()
        self.look = asyncio.Event()  # the watch loop has suspects to check
        self.taken = asyncio.Event()  # a task was taken away: the backlog looks at its own
        self.taken_ids: set[UUID] | None = set()  # which (None: too many to name)
        self.suspects: set[UUID] = set()
        # claim statements in flight (start.py), and the tasks taken-away notices named
        # meanwhile (None: too many to name): a claim's won attempt is not in `active` until
        # its reply is read, and a cancel that lands between its COMMIT and that would be lost
        self.claims_open = 0
        self.taken_early: set[UUID] | None = set()

    @property
    def running(self) -> int:
        """Attempts holding a slot here: their outcome is not written yet (their process
        may still run, or its outcome wait in the finish batch)."""
        return len(self.active)

    def all_reported(self) -> bool:
        """Every attempt holding a slot here has its outcome known: none can join a batch."""
        return len(self.unreported) >= len(self.active)

    @contextlib.contextmanager
    def claim_window(self) -> Iterator[None]:
        """Around a statement whose won attempts are begun after its reply (the starter's
        claim, the finisher's outcomes with claims, an adoption): the tasks taken-away notices
        name meanwhile are kept, for `taken_early_from` and `suspect` once they are begun."""
        self.claims_open += 1
        try:
            yield
        finally:
            self.claims_open -= 1
            if not self.claims_open:
                self.taken_early = set()

    def suspect(self, task_ids: set[UUID] | None = None) -> None:
        """These tasks (None: all here) may have been taken away: the watch loop looks."""
        mine = {task_id for task_id, _ in self.active}
        self.suspects.update(mine if task_ids is None else task_ids & mine)
        if self.claims_open:
            early = self.taken_early
            self.taken_early = None if early is None or task_ids is None else early | task_ids
        if self.suspects:
            self.look.set()

    def launch_of(self, attempt: Attempt) -> Launch:
        """What the backend is given to start a claimed attempt."""
        task = attempt.task
        env = {
            "SKED_HEARTBEAT_URL": self.settings.heartbeat_url,
            "SKED_HEARTBEAT_TOKEN": heartbeat.token(self.secret, task.id, task.attempt),
        }
        lease_s = lease.remaining_s(task.heartbeat_timeout_s, attempt.renewed_at, time.monotonic())
        return Launch(
            task.id,
            task.attempt,
            task.spec.job,
            task.timeout_s,
            env,
            task.inputs,
            lease_s,
            node=task.node,
            resources=task.spec.resources,
            incarnation=task.created_at.isoformat(),
        )

    async def taken_early_from(self, won: dict[UUID, Task]) -> set[UUID]:
        """Of the attempts a claim won, those a taken-away notice named since it was sent that
        are not Running in that attempt any more (canceled, paused): never to be started. With
        Postgres away, none: the watch loop stops them once started (`suspect`)."""
        early = self.taken_early
        look = list(won) if early is None else [i for i in won if i in early]
        if not look:
            return set()
        try:
            now = {t.id: t for t in await self.store.tasks.get_many(look)}
        except TRANSIENT:
            return set()
        return {
            i
            for i in look
            if (t := now.get(i)) is None
            or not (t.status is State.RUNNING and t.attempt == won[i].attempt)
        }

    async def receive(self, message: AbstractIncomingMessage) -> None:
        """A dispatch delivered (the consumer's callback)."""
        self.acks.received(message)
        await self.inbox.put(items_of(message))

    def placed(self, _c: object, _p: int, _ch: str, payload: str) -> None:
        """Attempts just placed on this node, told by the commit that placed them
        (notify.placed_channel): started from here, ahead of their dispatch message, which
        then finds them running or ended and starts nothing (`Starter._checked`)."""
        entries = placed(payload, self.id)
        if entries:
            delivery, now = Delivery(None, len(entries)), time.monotonic()
            self.inbox.put_nowait([Item(delivery, e, now) for e in entries])

    def ended_here(self, keys: Iterable[Key]) -> None:
        """These attempts' outcomes are written (see `ended`)."""
        ended = self.ended
        for key in keys:
            ended[key] = None
        while len(ended) > ENDED_KEPT:
            ended.popitem(last=False)

    async def hand_back(self, items: list[Item], reason: str) -> None:
        """Scheduling -> Ready for these unstarted dispatches in one statement, back in line
        with one push, then acknowledged. Best effort: if a server is away, recovery's
        stuck-in-Scheduling sweep does it."""
        # one move a task: a node may hold two items of one attempt (the placement's
        # notification and its dispatch message), or of two (the older one superseded)
        newest: dict[UUID, Dispatch] = {}
        for d in (item.dispatch for item in items):
            if d is not None and (d.task_id not in newest or d.attempt > newest[d.task_id].attempt):
                newest[d.task_id] = d
        moves = [fsm.plan(d, State.READY, reason) for d in newest.values()]
        with contextlib.suppress(*TRANSIENT):
            moved = await self.store.tasks.transition_many(moves)
            await self.queue.push(moved)
        await self.acks.ack(items)

    async def dead_letter(self, message: AbstractIncomingMessage | Item, reason: str) -> None:
        """A message (or one dispatch of one) this node cannot use goes to `sked.dead` with
        the reason, alone. A notification's dispatch has no message: it is dropped (its
        dispatch message, which follows, meets the same fate or fares better)."""
        whole = message.delivery.message if isinstance(message, Item) else message
        if whole is None:
            log.warning("dropping a dispatch told by notification: %s", reason)
            await self.acks.ack([message])
            return
        body = message.entry.raw if isinstance(message, Item) else message.body
        log.warning("dead-lettering a message from %s: %s", whole.routing_key, reason)
        await self.bus.dead_letter(body, reason, whole.routing_key or "")
        await self.acks.ack([message])


class Acks:
    """Acknowledging deliveries, several in one frame where that is safe.

    A multiple-ack of delivery tag T acknowledges every delivery of its channel up to T not
    acknowledged yet, so it is sent only when all of those are among the messages being
    acknowledged now. Every delivery on the consumer channel is recorded (`received`) as the
    first step of its callback; RabbitMQ delivers in tag order and the callbacks start in that
    order, so a delivery not recorded yet has a higher tag than any recorded one, and no
    multiple-ack reaches it. A message acknowledged some other way only makes later
    acknowledgements single ones. Before: one frame (and one write) per dispatch."""

    def __init__(self) -> None:
        self._open: dict[object, set[int]] = {}  # channel -> tags delivered, not acknowledged

    def received(self, message: AbstractIncomingMessage) -> None:
        channel = _channel_of(message)
        for old in [c for c in self._open if c is not channel and getattr(c, "is_closed", True)]:
            del self._open[old]  # a closed channel's deliveries were requeued by RabbitMQ
        if message.delivery_tag is not None:
            self._open.setdefault(channel, set()).add(message.delivery_tag)

    async def ack(self, messages: Iterable[AbstractIncomingMessage | Item | None]) -> None:
        """Acknowledge these (a dispatch: its message, once the last of the message's
        dispatches is settled); if the channel is gone, RabbitMQ requeues them, and a second
        delivery finds the task moved on and is dropped — so a failed ack loses nothing."""
        by_channel: dict[object, list[AbstractIncomingMessage]] = {}
        for item in messages:
            if isinstance(item, Item):
                message = item.delivery.message if item.settle() else None
            else:
                message = item
            if message is not None:
                by_channel.setdefault(_channel_of(message), []).append(message)
        for channel, some in by_channel.items():
            pending = self._open.get(channel, set())
            tagged = {m.delivery_tag: m for m in some if isinstance(m.delivery_tag, int)}
            upto = 0  # every delivery still open up to this tag is acknowledged now
            for tag in sorted(pending):
                if tag not in tagged:
                    break
                upto = tag
            covered = {t for t in tagged if t in pending and t <= upto}
            with contextlib.suppress(*TRANSIENT):
                if len(covered) > 1:
                    await tagged[upto].ack(multiple=True)
                else:
                    covered = set()
                for message in some:
                    if message.delivery_tag not in covered:
                        await message.ack()
            pending.difference_update(tagged)


def _channel_of(message: AbstractIncomingMessage) -> object:
    """The channel a message came on; None once it is closed (aio-pika then refuses to name
    it, and RabbitMQ has requeued its deliveries)."""
    try:
        return message.channel
    except ChannelInvalidStateError:
        return None


def report_of(outcome: Outcome) -> Report:
    """An outcome as the store and the monitor see it (without the backend's `stopped`)."""
    return Report.model_validate(outcome, from_attributes=True)
