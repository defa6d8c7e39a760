"""What one executor's parts share: the node's identity and collaborators, the attempts it
runs, and the queues between its loops (start -> outcomes -> finish; suspects -> watch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from uuid import UUID, uuid4

from aio_pika.abc import AbstractIncomingMessage

from services.executor.backends import Backend, Key, Outcome
from shared.bus import AmqpBus
from shared.models import Task
from shared.outcome import Report
from shared.policy import JobPolicy
from shared.queues import ReadyQueue
from shared.resilience import TRANSIENT
from shared.settings import Settings
from shared.store import Store

log = logging.getLogger(__name__)


@dataclass
class Attempt:
    task: Task  # as it stood after this executor's Scheduling -> Running CAS
    message: AbstractIncomingMessage | None  # its dispatch; None: adopted, not dispatched
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
        self.policy = JobPolicy.of(settings.allowed_handlers, settings.allowed_commands)
        self.boot_id = uuid4()  # this incarnation: the owner of the leases it takes
        # the node ids whose dispatches this executor takes (services.executor.serving)
        self.serves: set[str] = {self.id} if backend.offers() is None else set()
        self.active: dict[Key, Attempt] = {}
        # A backlog (SKED_PREFETCH, a local node only): RabbitMQ hands this node up to slots +
        # prefetch dispatches, and the starter claims one only while fewer than `slots`
        # attempts run here (`running`); `slot_freed` is set when an outcome becomes known.
        self.gated = settings.prefetch > 0 and backend.offers() is None
        self.slot_freed = asyncio.Event()
        # outcomes known here but not yet written: a probe gets the real outcome from these
        self.unreported: dict[Key, Outcome] = {}
        self.inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self.outcomes: asyncio.Queue[tuple[Attempt, Outcome] | None] = asyncio.Queue()
        self.runs: set[asyncio.Task[None]] = set()
        self.look = asyncio.Event()  # the watch loop has suspects to check
        self.suspects: set[UUID] = set()

    @property
    def running(self) -> int:
        """Attempts here whose outcome is not known yet (their process may still run)."""
        return len(self.active) - len(self.unreported)

    def suspect(self, task_ids: set[UUID] | None = None) -> None:
        """These tasks (None: all here) may have been taken away: the watch loop looks."""
        mine = {task_id for task_id, _ in self.active}
        self.suspects.update(mine if task_ids is None else task_ids & mine)
        if self.suspects:
            self.look.set()

    async def dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        """A message this node cannot use goes to `sked.dead` with the reason, alone."""
        log.warning("dead-lettering a message from %s: %s", message.routing_key, reason)
        await self.bus.dead_letter(message.body, reason, message.routing_key or "")
        await ack(message)


async def ack(message: AbstractIncomingMessage | None) -> None:
    """Acknowledge; if the channel is gone, RabbitMQ requeues the message, and its second
    delivery finds the task moved on and is dropped — so a failed ack loses nothing."""
    if message is None:
        return
    with contextlib.suppress(*TRANSIENT):
        await message.ack()


def report_of(outcome: Outcome) -> Report:
    """An outcome as the store and the monitor see it (without the backend's `stopped`)."""
    return Report.model_validate(outcome, from_attributes=True)
